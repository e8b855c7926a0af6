"""Run SGLang 0.5.23's own ``/generate`` contract gate (``generate_contract_error``) on bodies (JSON list on stdin).

Runs under the ``sglang-parser`` peer's Python (tandem_dev.peers); prints a JSON list with, per body, SGLang's 400
message or null when SGLang admits it.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from sglang.api.v1.api_types import GenerateRequest, JsonContractError

    out: list[str | None] = []
    for body in json.load(sys.stdin):
        try:
            GenerateRequest.from_json_value(body)
        except JsonContractError as err:
            out.append(str(err))
        else:
            out.append(None)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
