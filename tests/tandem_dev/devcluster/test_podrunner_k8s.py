"""The pod runner on the real control plane: `tandem sim` serves behind a simulated SGLang pod's IP, in the pod's
own network namespace, with the pod's own `python3 -m sglang.launch_server` flags and env; the pod is Ready only
when its readinessProbe passes, a container that exits shows in the pod's status as on a kubelet, and everything
goes away with the pod."""

from __future__ import annotations

import asyncio
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.devcluster.podstatus import ContainerView, Terminated, status_patch
from tandem_sim.pd.transfer import INIT_FAILED
from tests.tandem_dev.devcluster.devcluster_fixtures import create, eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(240)]


SERVER_ARGS = ["--model-path", "moonshotai/Kimi-K2.6", "--served-model-name", "kimi", "--trust-remote-code"]


def sglang_pod(
    name: str,
    image: str,
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    probe: bool = False,
    restart_policy: str = "Always",
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "sglang",
        "image": image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": [*SERVER_ARGS, "--host", "0.0.0.0", "--port", "30000", *args],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *({"name": k, "value": v} for k, v in (env or {}).items()),
        ],
        "ports": [{"name": "http", "containerPort": 30000}],
        "resources": {"limits": {"nvidia.com/gpu": "8"}},
    }
    if probe:
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1}
    spec = {"containers": [container], "restartPolicy": restart_policy}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def _http_status(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(2)) as resp:
            return resp.status
    except (aiohttp.ClientError, TimeoutError):  # a gone pod's IP answers nothing: the connect times out
        return None


async def test_pod_runner_serves_tandem_sim_on_the_pod_ip_and_stops_it_with_the_pod(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(k8s_api)
    async with PodRunner(k8s_api, tmp_path, namespace=k8s_namespace).running_in_background() as runner:
        await create(k8s_api, k8s_namespace, sglang_pod("decode-0", "lmsysorg/sglang:v0.5.23-cu129"))
        await create(k8s_api, k8s_namespace, sglang_pod("not-sglang", "registry.invalid/other:1"))

        async def pod_ip() -> str | None:
            pod = await core.read_namespaced_pod("decode-0", k8s_namespace)
            return pod.status.pod_ip if pod.status.phase == "Running" else None

        ip = await eventually(pod_ip, "decode-0 to run with an IP")
        base = f"http://{ip}:30000"
        assert await eventually(lambda: _http_status(f"{base}/health"), f"tandem sim on {base}", within=90) == 200
        launches = [launch for launch, _ in runner.running.values()]
        assert [launch.pod for launch in launches] == [f"{k8s_namespace}/decode-0"]
        assert launches[0].server_args == (*SERVER_ARGS, "--host", "0.0.0.0", "--port", "30000")  # as in the pod
        assert dict(launches[0].env) == {"POD_NAME": "decode-0"}

        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused") as sdk:
            assert [m.id for m in (await sdk.models.list()).data] == ["kimi"]
            completion = await sdk.completions.create(model="kimi", prompt="The pod runner", max_tokens=4)
            assert completion.choices[0].text

        (proc,) = [proc for _, proc in runner.running.values()]
        await core.delete_namespaced_pod("decode-0", k8s_namespace)

        async def stopped() -> bool:
            return not runner.running and not proc.alive() and await _http_status(f"{base}/health") is None

        await eventually(stopped, "tandem sim to stop with its pod", within=30)


# A decode worker with Mooncake over TCP and the operator's two-port range: the same ports in every pod.
DECODE_ARGS = ("--disaggregation-mode", "decode")
TCP_ENV = {"MC_FORCE_TCP": "true", "MC_MIN_RPC_PORT": "15000", "MC_MAX_RPC_PORT": "15001"}
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23-cu129"


async def _pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    pod = await client.CoreV1Api(api).read_namespaced_pod(name, namespace)
    data: dict[str, Any] = api.sanitize_for_serialization(pod)
    return data


def _condition(pod: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in pod["status"].get("conditions") or () if c["type"] == kind), None)


async def test_pods_bind_the_same_ports_in_their_own_namespaces_and_are_ready_only_when_their_probe_passes(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    names = ("decode-a", "decode-b")
    async with PodRunner(k8s_api, tmp_path, namespace=k8s_namespace).running_in_background() as runner:
        created = time.monotonic()
        for name in names:
            pod = sglang_pod(name, SGLANG_IMAGE, args=DECODE_ARGS, env=TCP_ENV, probe=True, restart_policy="Never")
            await create(k8s_api, k8s_namespace, pod)

        async def running(name: str) -> dict[str, Any] | None:
            pod = await _pod(k8s_api, k8s_namespace, name)
            return pod if pod["status"].get("podIP") and pod["status"].get("phase") == "Running" else None

        first = await eventually(lambda: running(names[0]), "decode-a running with an IP")
        # kwok gave it an IP, but no probe has passed yet: not Ready (kwok no longer says so).
        assert (_condition(first, "Ready"), first["status"]["containerStatuses"][0]["ready"]) == ("False", False)

        async def ready(name: str) -> dict[str, Any] | None:
            pod = await _pod(k8s_api, k8s_namespace, name)
            return pod if _condition(pod, "Ready") == "True" else None

        pods = [await eventually(partial(ready, name), f"{name} Ready", within=90) for name in names]
        ready_s = time.monotonic() - created
        ips = [pod["status"]["podIP"] for pod in pods]
        # Same --port and Mooncake range, wildcard binds (Mooncake's), no collision: each pod has its network.
        for ip in ips:
            assert await _http_status(f"http://{ip}:30000/health") == 200
        print(f"\ntwo decode pods created -> both Ready (probe passed): {ready_s:.1f} s")

        # The worker of decode-a dies: restartPolicy Never, so the container is terminated and the pod Failed.
        (victim,) = [proc for launch, proc in runner.running.values() if launch.pod.endswith("/decode-a")]
        victim.signal(signal.SIGKILL)

        async def failed() -> dict[str, Any] | None:
            pod = await _pod(k8s_api, k8s_namespace, "decode-a")
            return pod if pod["status"]["phase"] == "Failed" else None

        pod = await eventually(failed, "decode-a Failed", within=30)
        (status,) = pod["status"]["containerStatuses"]
        assert status["state"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
        assert (_condition(pod, "Ready"), status["ready"]) == ("False", False)
        assert await _http_status(f"http://{ips[1]}:30000/health") == 200  # the other pod is untouched


async def test_a_restarted_container_keeps_its_pod_and_ip_and_counts_the_restart(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    async with PodRunner(k8s_api, tmp_path, namespace=k8s_namespace).running_in_background() as runner:
        await create(k8s_api, k8s_namespace, sglang_pod("worker", SGLANG_IMAGE, probe=True))

        async def ready_with(restarts: int) -> dict[str, Any] | None:
            pod = await _pod(k8s_api, k8s_namespace, "worker")
            statuses = pod["status"].get("containerStatuses") or [{}]
            ok = _condition(pod, "Ready") == "True" and statuses[0].get("restartCount") == restarts
            return pod if ok else None

        before = await eventually(lambda: ready_with(0), "worker Ready", within=90)
        (proc,) = [proc for _, proc in runner.running.values()]
        proc.signal(signal.SIGKILL)
        after = await eventually(lambda: ready_with(1), "worker restarted and Ready again", within=90)
        assert after["status"]["podIP"] == before["status"]["podIP"]
        (status,) = after["status"]["containerStatuses"]
        assert status["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
        assert await _http_status(f"http://{after['status']['podIP']}:30000/health") == 200


async def test_pods_fail_and_serve_as_their_spec_would_on_gpus(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    """The pod's real env and flags reach the multi-rank simulator, so a spec that cannot work on GPU nodes fails
    here too, and the pod says so (Failed, exit code, NotReady):

    * 8 ranks (``--tp-size 8``) over Mooncake TCP need 16 ports (an RPC and a data port per engine): the two-port
      range the operator once gave a TCP pod fails at start, the 16-port range serves with 8 sessions in it;
    * node 0 of a group whose ``--dist-init-addr`` is not its own address cannot bind it (torch's TCPStore).
    """
    ranks = ("--tp-size", "8", *DECODE_ARGS)
    wide = {**TCP_ENV, "MC_MAX_RPC_PORT": "15015"}
    wrong_leader = ("--tp-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.10.255.1:5000")
    specs = {"two-ports": (ranks, TCP_ENV), "sixteen-ports": (ranks, wide), "wrong-addr": (wrong_leader, TCP_ENV)}
    async with PodRunner(k8s_api, tmp_path, namespace=k8s_namespace).running_in_background():
        for name, (args, env) in specs.items():
            pod = sglang_pod(name, SGLANG_IMAGE, args=args, env=env, probe=True, restart_policy="Never")
            await create(k8s_api, k8s_namespace, pod)

        async def phase(name: str, wanted: str) -> dict[str, Any] | None:
            pod = await _pod(k8s_api, k8s_namespace, name)
            done = pod["status"].get("phase") == wanted and (wanted != "Running" or _condition(pod, "Ready") == "True")
            return pod if done else None

        serving = await eventually(partial(phase, "sixteen-ports", "Running"), "the 16-port pod Ready", within=120)
        async with aiohttp.ClientSession() as session:
            url = f"http://{serving['status']['podIP']}:30000/server_info"
            async with session.get(url) as resp:
                states = (await resp.json())["internal_states"]
        ports = sorted(int(state["session_id"].rsplit(":", 1)[1]) for state in states)
        assert len(ports) == 8
        assert all(15000 <= port <= 15015 for port in ports)
        for name, message in (("two-ports", INIT_FAILED), ("wrong-addr", "The server socket has failed to bind")):
            failed = await eventually(partial(phase, name, "Failed"), f"the {name} pod Failed", within=120)
            (status,) = failed["status"]["containerStatuses"]
            assert status["state"]["terminated"]["exitCode"] == 1
            assert _condition(failed, "Ready") == "False"
            (log,) = await asyncio.to_thread(_logs, tmp_path, f"{k8s_namespace}_{name}-*.log")
            assert message in await asyncio.to_thread(log.read_text)


def _logs(directory: Path, pattern: str) -> list[Path]:
    return list(directory.glob(pattern))


async def test_a_deleted_pods_last_status_report_never_lands_on_its_same_name_successor(
    k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    """The operator recreates a group's pods under the same names at once; the old container's exit (its group
    lost a rank) is reported moments later. The report names the old pod's UID, so the real API server refuses it
    instead of marking the new pod Failed (which made the operator recreate a healthy group a second time)."""
    core = client.CoreV1Api(k8s_api)
    await create(k8s_api, k8s_namespace, sglang_pod("rank-0", SGLANG_IMAGE))
    old = await eventually(lambda: _running(k8s_api, k8s_namespace, "rank-0"), "the first rank-0 Running")
    await core.delete_namespaced_pod("rank-0", k8s_namespace, grace_period_seconds=0)
    await create(k8s_api, k8s_namespace, sglang_pod("rank-0", SGLANG_IMAGE))
    new = await eventually(
        lambda: _running(k8s_api, k8s_namespace, "rank-0", not_uid=old["metadata"]["uid"]), "a new rank-0"
    )

    t1, t2 = "2026-12-01T00:00:01Z", "2026-12-01T00:00:02Z"
    exited = ContainerView("sglang", SGLANG_IMAGE, t1, terminated=Terminated(1, t1, t2))
    with pytest.raises(client.ApiException) as refused:
        await core.patch_namespaced_pod_status("rank-0", k8s_namespace, status_patch(old, exited, "Never", t2))
    assert refused.value.status == 422, refused.value.body
    assert "metadata.uid" in str(refused.value.body)
    now = await _pod(k8s_api, k8s_namespace, "rank-0")
    assert (now["metadata"]["uid"], now["status"]["phase"]) == (new["metadata"]["uid"], "Running")
    await core.patch_namespaced_pod_status("rank-0", k8s_namespace, status_patch(new, exited, "Never", t2))
    assert (await _pod(k8s_api, k8s_namespace, "rank-0"))["status"]["phase"] == "Failed"  # its own report lands


async def _running(api: client.ApiClient, namespace: str, name: str, not_uid: str = "") -> dict[str, Any] | None:
    try:
        pod = await _pod(api, namespace, name)
    except client.ApiException:
        return None
    return pod if pod["status"].get("phase") == "Running" and pod["metadata"]["uid"] != not_uid else None
