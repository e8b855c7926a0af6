"""Run SGLang 0.5.23's own ``prepare_server_args`` on command lines (JSON list of argv lists on stdin).

Runs under the ``sglang-parser`` peer's Python (tandem_dev.peers), never under Tandem's venv: it imports only sglang
and the standard library. Prints one JSON object per argv: ``{"ok": true, "args": {...}}`` with the parsed values
of a few fields, or ``{"ok": false, "error": "<what argparse printed>"}`` when SGLang exits (status 2).

What this checks: argparse (every flag exists in 0.5.23, its value has the right type, is one of its choices,
takes the right number of values) and ``ServerArgs.from_cli_args``. What it does not check: the resolution
pipeline (``ServerArgs.resolve_once``, run by ``launch_server``), which needs ``transformers``, the model's
``config.json`` from the hub and the GPU platform, none of which exist here; its cross-flag rules are not run.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

FIELDS = ("model_path", "tp_size", "ep_size", "nnodes", "node_rank", "disaggregation_mode", "dist_init_addr", "port")


def parse(argv: list[str]) -> dict[str, object]:
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = prepare_server_args(argv)
    except SystemExit as exc:
        return {"ok": False, "status": exc.code, "error": err.getvalue().strip().splitlines()[-1:]}
    return {"ok": True, "args": {name: getattr(args, name, None) for name in FIELDS}}


def main() -> int:
    argvs = json.load(sys.stdin)
    results = [parse(argv) for argv in argvs]
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
