"""The ``tandem`` command line: one entry point, one subcommand per component.

Each subcommand lives in its own package and is imported lazily, so ``tandem sim`` does not pay for importing
the operator's Kubernetes client, and a broken optional dependency only breaks the subcommand that needs it.
The development commands (``up``, ``bench``, ``chaos``, ``dev-cluster``) live in ``tandem_dev``, which the runtime
wheel and image leave out: there they fail with a message naming the missing package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

DEV_PACKAGE = "tandem_dev"
# subcommand -> (module, function, one-line help). The function takes argv (without the subcommand) and
# returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "sim": (
        "tandem_sim.main",
        "main",
        "simulated SGLang worker (drop-in for python -m sglang.launch_server)",
    ),
    "router": ("tandem_router.main", "main", "OpenAI-compatible prefill/decode router"),
    "operator": ("tandem_operator.cli", "main", "Kubernetes operator for PDCluster/PDPool"),
    "render": ("tandem_operator.run.render", "main", "print every manifest the operator would create for a PDCluster"),
    "up": ("tandem_dev.local_stack_cli", "main", "run the embedded local stack: etcd, workers, router on :8000"),
    "bench": ("tandem_dev.bench.run", "main", "run the benchmarks and print tables"),
    "chaos": (
        "tandem_dev.chaos.cli",
        "main",
        "a bounded chaos run (local stack, or --setting dev-cluster): faults under load, table + plots",
    ),
    "etcd-auth": ("tandem.etcd_auth", "main", "create the registry etcd's users and roles and turn its auth on"),
    "dev-cluster": (
        "tandem_dev.devcluster.cli",
        "main",
        "start a real Kubernetes control plane with fake GPU nodes",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: tandem <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'tandem <command> --help' for the options of one command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from tandem import __version__

        print(f"tandem {__version__}")
        return 0
    name = args[0]
    if name not in SUBCOMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != DEV_PACKAGE:
            raise
        print(
            f"tandem {name}: needs the development package {DEV_PACKAGE!r}, which this installation does not have "
            "(the runtime wheel and image ship only runtime code); run it from a source checkout after "
            "scripts/bootstrap.sh",
            file=sys.stderr,
        )
        return 2
    func: Callable[[list[str]], int] = getattr(module, func_name)
    return func(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
