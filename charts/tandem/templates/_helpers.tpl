{{/* Names and labels. */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The etcd client endpoints as a list of host:port. */}}
{{- define "tandem.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.endpoints -}}
{{- else -}}
{{- $name := printf "%s-etcd" (include "tandem.fullname" .) -}}
{{- printf "%s.%s.svc:2379" $name .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
Non-empty when the chart deploys the plaintext Mooncake etcd (mooncakeEtcd.deploy; 'auto': a master and a registry
etcd with TLS, which Mooncake's etcd client cannot speak, and no etcd of the user's own named).
*/}}
{{- define "tandem.mooncakeEtcd" -}}
{{- $mode := .Values.mooncakeEtcd.deploy -}}
{{- $auto := and .Values.mooncakeMaster.enabled (include "tandem.etcdSecure" .) (empty .Values.mooncakeMaster.etcdEndpoints) -}}
{{- if or (eq $mode "always") (and (eq $mode "auto") $auto) -}}true{{- end -}}
{{- end -}}

{{- define "tandem.mooncakeEtcdName" -}}
{{- printf "%s-mooncake-etcd" (include "tandem.fullname" .) -}}
{{- end -}}

{{/* Where Mooncake's keys live, host:port comma-separated: the user's etcd, the chart's Mooncake etcd, or the registry's. */}}
{{- define "tandem.mooncakeEtcdEndpoints" -}}
{{- if .Values.mooncakeMaster.etcdEndpoints -}}
{{- join "," .Values.mooncakeMaster.etcdEndpoints -}}
{{- else if include "tandem.mooncakeEtcd" . -}}
{{- printf "%s.%s.svc:2379" (include "tandem.mooncakeEtcdName" .) .Release.Namespace -}}
{{- else -}}
{{- include "tandem.etcdEndpoints" . -}}
{{- end -}}
{{- end -}}

{{- define "tandem.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Rules values.schema.json cannot express. Each failure names the values key to change.
*/}}
{{- define "tandem.validateValues" -}}
{{- $errors := list -}}
{{- if and (eq .Values.etcd.mode "external") (empty .Values.etcd.endpoints) -}}
{{- $errors = append $errors "etcd.endpoints: etcd.mode is 'external' but no endpoints are given" -}}
{{- end -}}
{{- if and (eq .Values.etcd.mode "embedded") (eq (mod (int .Values.etcd.replicas) 2) 0) -}}
{{- $errors = append $errors (printf "etcd.replicas: %d members cannot keep quorum better than %d; use an odd number" (int .Values.etcd.replicas) (sub (int .Values.etcd.replicas) 1)) -}}
{{- end -}}
{{- if and .Values.router.hpa.enabled (gt (int .Values.router.hpa.minReplicas) (int .Values.router.hpa.maxReplicas)) -}}
{{- $errors = append $errors "router.hpa.minReplicas: greater than router.hpa.maxReplicas" -}}
{{- end -}}
{{- if and .Values.router.enabled .Values.router.pdb.enabled (not .Values.router.hpa.enabled) (ge (int .Values.router.pdb.minAvailable) (int .Values.router.replicas)) -}}
{{- $errors = append $errors (printf "router.pdb.minAvailable: %d would block every voluntary eviction of %d router replicas; lower it or add replicas" (int .Values.router.pdb.minAvailable) (int .Values.router.replicas)) -}}
{{- end -}}
{{- if and .Values.mooncakeMaster.enabled (include "tandem.etcdSecure" .) (empty .Values.mooncakeMaster.etcdEndpoints) (not (include "tandem.mooncakeEtcd" .)) -}}
{{- $errors = append $errors "mooncakeEtcd.deploy: Mooncake's etcd client cannot use TLS or etcd users (mooncake-common/etcd/etcd_wrapper.go), so with etcd.tls.enabled the master needs a plaintext etcd of its own: the chart's ('auto') or yours in mooncakeMaster.etcdEndpoints (charts/tandem/README.md)" -}}
{{- end -}}
{{- if and (eq .Values.mooncakeEtcd.deploy "always") .Values.mooncakeMaster.etcdEndpoints -}}
{{- $errors = append $errors "mooncakeEtcd.deploy: 'always' deploys a Mooncake etcd, but mooncakeMaster.etcdEndpoints names another; drop one" -}}
{{- end -}}
{{- if and (include "tandem.mooncakeEtcd" .) (eq (mod (int .Values.mooncakeEtcd.replicas) 2) 0) -}}
{{- $errors = append $errors (printf "mooncakeEtcd.replicas: %d members cannot keep quorum better than %d; use an odd number" (int .Values.mooncakeEtcd.replicas) (sub (int .Values.mooncakeEtcd.replicas) 1)) -}}
{{- end -}}
{{- if and .Values.mooncakeMaster.enabled (eq .Values.etcd.mode "external") (empty .Values.etcd.endpoints) -}}
{{- $errors = append $errors "mooncakeMaster.enabled: the master's HA needs etcd endpoints" -}}
{{- end -}}
{{- if and .Values.router.enabled .Values.networkPolicy.enabled (ne .Values.router.service.type "ClusterIP") (empty .Values.networkPolicy.routerCidrs) -}}
{{- $errors = append $errors (printf "networkPolicy.routerCidrs: a %s router Service is reached from outside the cluster, which the router's NetworkPolicy denies unless its clients' CIDRs are listed (0.0.0.0/0: everyone)" .Values.router.service.type) -}}
{{- end -}}
{{- if $errors -}}
{{- fail (printf "\n\ninvalid values:\n  - %s\n" (join "\n  - " $errors)) -}}
{{- end -}}
{{- end -}}

{{/* Non-empty when the embedded etcd runs with TLS, client certificates and roles (etcd.tls.enabled). */}}
{{- define "tandem.etcdSecure" -}}
{{- if and (eq .Values.etcd.mode "embedded") .Values.etcd.tls.enabled -}}true{{- end -}}
{{- end -}}

{{/* Non-empty when cert-manager issues the etcd certificates (etcd.tls.certManager). */}}
{{- define "tandem.certManager" -}}
{{- $mode := .Values.etcd.tls.certManager -}}
{{- if or (eq $mode "always") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1")) -}}true{{- end -}}
{{- end -}}

{{/* Secret names of the etcd PKI: <etcd>-server-tls, <etcd>-<user>-tls, <fullname>-registry-signing. */}}
{{- define "tandem.etcdSecret" -}}
{{- if eq .name "registry-signing" -}}
{{- printf "%s-registry-signing" (include "tandem.fullname" .root) -}}
{{- else -}}
{{- printf "%s-etcd-%s-tls" (include "tandem.fullname" .root) .name -}}
{{- end -}}
{{- end -}}

{{/*
The router's flags made from its values: the one place where router values become router settings. The values keep
the settings' names (tandem_router.config.RouterSettings, camelCase, nested alike: router.flowControl.enabled is
flow_control.enabled, flag --flow-control; tests/chart/test_chart_render.py parses these flags with the router's own
parser). dig, not field access, for the values a release from before them lacks (`helm upgrade --reuse-values`).
*/}}
{{- define "tandem.routerFlags" -}}
{{- $router := .Values.router }}
{{- $flow := $router.flowControl | default dict }}
- --workers={{ $router.processes }}
- --policy={{ $router.policy }}
- --max-concurrent-requests={{ $router.maxConcurrentRequests }}
- --drain-timeout-s={{ $router.drainTimeoutSeconds }}
{{- with dig "clientIdHeader" "" $router | default (dig "clientIdHeader" "" $flow) }}
- --client-id-header={{ . }}
{{- end }}
- --{{ if not (dig "enabled" true $flow) }}no-{{ end }}flow-control
{{- if dig "limits" nil $flow }}
- --flow-limits-file=/etc/tandem/flow/limits.yaml
{{- end }}
{{- /* router.<group>.<setting> values generated from the router's settings (_router_settings.tpl): a flag for
       each one set (null: the router's default, no flag); booleans --x/--no-x, integers as integers */}}
{{- range $group, $settings := include "tandem.routerSettingFlags" . | fromJson }}
{{- $given := index $router $group | default dict }}
{{- range $key, $spec := $settings }}
{{- if and (hasKey $given $key) (not (kindIs "invalid" (index $given $key))) }}
{{- $value := index $given $key }}
{{- $flag := index $spec 0 }}
{{- if eq (index $spec 1) "boolean" }}
- --{{ if not $value }}no-{{ end }}{{ trimPrefix "--" $flag }}
{{- else if eq (index $spec 1) "integer" }}
- {{ $flag }}={{ int64 $value }}
{{- else }}
- {{ $flag }}={{ $value }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Flags and mounts that give a component (.user: operator or router) its etcd client certificate. */}}
{{- define "tandem.etcdClientFlags" -}}
- --etcd-ca-file=/etc/tandem/etcd/ca.crt
- --etcd-cert-file=/etc/tandem/etcd/tls.crt
- --etcd-key-file=/etc/tandem/etcd/tls.key
{{- if eq .user "operator" }}
- --registry-signing-key=/etc/tandem/registry/tls.key
{{- else }}
- --registry-verify-key=/etc/tandem/registry/tls.crt
{{- end }}
{{- end -}}

{{- define "tandem.etcdClientMounts" -}}
- {name: etcd-tls, mountPath: /etc/tandem/etcd, readOnly: true}
- {name: registry-signing, mountPath: /etc/tandem/registry, readOnly: true}
{{- end -}}

{{- define "tandem.etcdClientVolumes" -}}
- name: etcd-tls
  secret: {secretName: {{ include "tandem.etcdSecret" (dict "root" .root "name" .user) }}}
- name: registry-signing
  secret:
    secretName: {{ include "tandem.etcdSecret" (dict "root" .root "name" "registry-signing") }}
    # the operator gets the private key; routers only the certificate holding the public key
    items: [{key: {{ ternary "tls.key" "tls.crt" (eq .user "operator") }}, path: {{ ternary "tls.key" "tls.crt" (eq .user "operator") }}}]
{{- end -}}

{{/*
Hardened security contexts shared by every pod the chart makes (the operator's worker pods get theirs from
tandem_operator/desired/pods.py): a fixed non-root user, the runtime's default seccomp profile, no privilege
escalation, a read-only root filesystem and no capabilities at all.
*/}}
{{- define "tandem.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  fsGroup: 65532
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "tandem.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {drop: [ALL]}
{{- end -}}

{{/* NetworkPolicy peers from a list of values entries with namespaceLabels and podLabels ({} matches all). */}}
{{- define "tandem.peers" -}}
{{- range . }}
- namespaceSelector:
    matchLabels: {{- toYaml (.namespaceLabels | default dict) | nindent 6 }}
  podSelector:
    matchLabels: {{- toYaml (.podLabels | default dict) | nindent 6 }}
{{- end }}
{{- end -}}
