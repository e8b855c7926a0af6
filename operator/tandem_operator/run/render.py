"""``tandem render -f pdcluster.yaml [-n NS]``: every manifest the operator would create for a PDCluster -- its
two PDPools, one headless Service and the pods (full SGLang command lines) of each initial group -- printed as
YAML without a cluster, so GPU pods can be reviewed before they are spent. An invalid PDCluster gets the field
paths and messages the API server's CEL and OpenAPI checks would give (``api.messages``) and exit status 1.

Objects a real cluster fills in are left as the operator leaves them: ``ownerReferences[].uid`` (the PDCluster's
and PDPools' uids) reads ``RENDER_UID``; every group is at epoch 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from tandem.registry import Role
from tandem_operator.api.common import API_VERSION
from tandem_operator.api.messages import api_messages
from tandem_operator.api.pdcluster import CLUSTER_NAME_RULES, PDClusterSpec
from tandem_operator.api.upgrade import ANNOTATION_ROLL, InvalidTriggerError, parse_trigger
from tandem_operator.decide.recovery import stamp_epoch
from tandem_operator.desired.naming import ClusterRef, OwnerRef, pool_name
from tandem_operator.desired.pods import RoleContext, group_manifests
from tandem_operator.desired.pools import pool_manifest

RENDER_UID = "assigned-by-the-api-server"
# Strings YAML 1.2 (kubectl's reader) takes for numbers but PyYAML's YAML 1.1 emitter leaves unquoted, e.g. a hash
# label "10363090e8" (a float to kubectl: "cannot unmarshal number into ... labels of type string").
_YAML12_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+")


class _KubectlDumper(yaml.SafeDumper):
    """Quotes every string a YAML 1.2 reader would take for a number."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "'" if _YAML12_NUMBER.fullmatch(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_KubectlDumper.add_representer(str, _represent_str)


def to_yaml(docs: Sequence[Mapping[str, Any]]) -> str:
    """``docs`` as a YAML stream kubectl reads back with every string still a string."""
    return yaml.dump_all(docs, Dumper=_KubectlDumper, sort_keys=False, width=120)


class InvalidClusterError(ValueError):
    def __init__(self, name: str, messages: list[str]) -> None:
        listed = messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"
        super().__init__(f'The PDCluster "{name}" is invalid: {listed}')
        self.messages = messages


def render(doc: Mapping[str, Any], namespace: str | None = None) -> list[dict[str, Any]]:
    """The manifests for one PDCluster document; raises ``InvalidClusterError`` like the API server would."""
    meta = doc.get("metadata") or {}
    name = str(meta.get("name", ""))
    errors = [f'Invalid value: "object": {rule.message}' for rule in CLUSTER_NAME_RULES if not rule.check(name)]
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "PDCluster":
        errors.append(f"a {API_VERSION} PDCluster is expected, got {doc.get('apiVersion')} {doc.get('kind')}")
    try:
        spec = PDClusterSpec.model_validate(doc.get("spec") or {})
    except pydantic.ValidationError as err:
        errors += api_messages(err)
    try:  # the operator refuses it the same way (the PodsOutdated condition); no CEL rule can see annotations
        parse_trigger((meta.get("annotations") or {}).get(ANNOTATION_ROLL))
    except InvalidTriggerError as err:
        errors.append(str(err))
    if errors:
        raise InvalidClusterError(name, errors)
    cluster = ClusterRef(name, namespace or str(meta.get("namespace") or "default"), RENDER_UID)
    manifests = [pool_manifest(cluster, spec, role, create=True) for role in Role]
    for role in Role:
        owner = OwnerRef(API_VERSION, "PDPool", pool_name(name, role), RENDER_UID)
        ctx = RoleContext.build(cluster, spec, role, owner)
        for group in range(spec.role(role).groups):
            manifests += [stamp_epoch(m, 0) for m in group_manifests(ctx, group)]
    return manifests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem render", description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--filename", required=True, help="PDCluster YAML ('-': stdin)")
    parser.add_argument("-n", "--namespace", default=None, help="default: the file's metadata.namespace, else default")
    args = parser.parse_args(argv)
    source = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(source) if d]
    except yaml.YAMLError as err:
        print(f"error: {args.filename}: {err}", file=sys.stderr)
        return 1
    out: list[dict[str, Any]] = []
    failed = False
    for doc in docs:
        try:
            out += render(doc, args.namespace)
        except InvalidClusterError as err:
            print(f"error: {err}", file=sys.stderr)
            failed = True
    if failed:
        return 1
    sys.stdout.write(to_yaml(out))
    return 0
