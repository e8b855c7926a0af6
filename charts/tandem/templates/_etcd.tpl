{{/*
An etcd cluster: a headless peer Service, a client Service and a StatefulSet of static-bootstrap members, hardened
like every chart pod. Used for the registry etcd (etcd.yaml: TLS, client certificates) and the plaintext Mooncake
etcd (mooncake-etcd.yaml). Arguments: root, name, component, replicas, tls (non-empty: server/peer TLS from the
<fullname>-etcd-server-tls Secret), persistence (enabled, size, storageClass), resources.
*/}}
{{- define "tandem.etcdCluster" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $component := .component }}
{{- $ns := $root.Release.Namespace }}
{{- $replicas := int .replicas }}
{{- $tls := .tls }}
{{- $persistence := .persistence }}
{{- $scheme := ternary "https" "http" (not (empty $tls)) }}
# Headless Service: stable peer DNS names <name>-<i>.<name>.<ns>.svc for the static bootstrap cluster.
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}-peers
  namespace: {{ $ns }}
  labels: {{- include "tandem.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector: {{- include "tandem.selector" (dict "root" $root "component" $component) | nindent 4 }}
  ports:
    - {name: peer, port: 2380}
    - {name: client, port: 2379}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $ns }}
  labels: {{- include "tandem.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  selector: {{- include "tandem.selector" (dict "root" $root "component" $component) | nindent 4 }}
  ports:
    - {name: client, port: 2379}
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  namespace: {{ $ns }}
  labels: {{- include "tandem.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  serviceName: {{ $name }}-peers
  replicas: {{ $replicas }}
  podManagementPolicy: Parallel
  selector:
    matchLabels: {{- include "tandem.selector" (dict "root" $root "component" $component) | nindent 6 }}
  template:
    metadata:
      labels: {{- include "tandem.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $component }}
    spec:
      {{- include "tandem.podSecurityContext" $root | nindent 6 }}
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels: {{- include "tandem.selector" (dict "root" $root "component" $component) | nindent 20 }}
      containers:
        - name: etcd
          image: {{ $root.Values.etcd.image }}
          command:
            - etcd
            - --name=$(POD_NAME)
            - --data-dir=/var/lib/etcd
            - --listen-client-urls={{ $scheme }}://0.0.0.0:2379
            - --advertise-client-urls={{ $scheme }}://$(POD_NAME).{{ $name }}-peers.{{ $ns }}.svc:2379
            - --listen-peer-urls={{ $scheme }}://0.0.0.0:2380
            - --initial-advertise-peer-urls={{ $scheme }}://$(POD_NAME).{{ $name }}-peers.{{ $ns }}.svc:2380
            - --initial-cluster-token={{ $name }}
            - --initial-cluster-state=new
            - --initial-cluster={{- range $i, $_ := until $replicas }}{{ if $i }},{{ end }}{{ $name }}-{{ $i }}={{ $scheme }}://{{ $name }}-{{ $i }}.{{ $name }}-peers.{{ $ns }}.svc:2380{{- end }}
            - --auto-compaction-retention=1h
            {{- if $tls }}
            # Server and peer TLS; a client's certificate CN is its etcd user (roles: tandem etcd-auth, the Job).
            - --cert-file=/etc/etcd/tls/tls.crt
            - --key-file=/etc/etcd/tls/tls.key
            - --trusted-ca-file=/etc/etcd/tls/ca.crt
            - --client-cert-auth
            - --peer-cert-file=/etc/etcd/tls/tls.crt
            - --peer-key-file=/etc/etcd/tls/tls.key
            - --peer-trusted-ca-file=/etc/etcd/tls/ca.crt
            - --peer-client-cert-auth
            - --listen-metrics-urls=http://0.0.0.0:2381  # /health and /metrics only, for the probe
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
          ports:
            - {name: client, containerPort: 2379}
            - {name: peer, containerPort: 2380}
            {{- if $tls }}
            - {name: metrics, containerPort: 2381}
            {{- end }}
          readinessProbe:
            httpGet: {path: /health, port: {{ ternary "metrics" "client" (not (empty $tls)) }}}
            periodSeconds: 5
          resources: {{- toYaml .resources | nindent 12 }}
          {{- include "tandem.containerSecurityContext" $root | nindent 10 }}
          volumeMounts:
            - {name: data, mountPath: /var/lib/etcd}
            {{- if $tls }}
            - {name: tls, mountPath: /etc/etcd/tls, readOnly: true}
            {{- end }}
      {{- if or $tls (not $persistence.enabled) }}
      volumes:
        {{- if not $persistence.enabled }}
        - name: data
          emptyDir: {}
        {{- end }}
        {{- if $tls }}
        - name: tls
          secret: {secretName: {{ include "tandem.etcdSecret" (dict "root" $root "name" "server") }}}
        {{- end }}
      {{- end }}
  {{- if $persistence.enabled }}
  # Kept on `helm uninstall` (StatefulSet PVCs are never deleted by Helm): the registry's data survives.
  volumeClaimTemplates:
    - metadata:
        name: data
      spec:
        accessModes: [ReadWriteOnce]
        {{- with $persistence.storageClass }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $persistence.size }}
  {{- end }}
{{- end -}}
