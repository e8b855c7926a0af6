"""Bounded streaming load through the router with the ``openai`` SDK, in its own process (so the test's event loop
measures fence times undisturbed). Prints one JSON line: ok, cut_mid_stream, failed_before_first_byte, and with
``--gaps`` also gaps: ``[wall-clock time, seconds since the stream's previous chunk]`` for every chunk after a
stream's first (the client-side inter-token latency).

Usage: python load_client.py <base_url> <model> <streams> <seconds> [<max_tokens>, default 16] [--gaps];
SIGTERM ends the load early (streams in flight finish, then the JSON line is printed).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import openai


async def main(
    base_url: str, model: str, streams: int, seconds: float, max_tokens: int = 16, record_gaps: bool = False
) -> dict[str, object]:
    result: dict[str, object] = {"ok": 0, "cut_mid_stream": 0, "failed_before_first_byte": []}
    failed: list[str] = []
    gaps: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)

    def stop() -> None:
        nonlocal deadline
        deadline = 0.0

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)

    async def worker(w: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            received = False
            try:
                stream = await sdk.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"count to {w}-{n}"}],
                    max_tokens=max_tokens,
                    stream=True,
                )
                last: float | None = None
                async for _ in stream:
                    now = time.monotonic()
                    if last is not None:
                        gaps.append((time.time(), now - last))
                    received, last = True, now
                result["ok"] = int(str(result["ok"])) + 1
            except openai.OpenAIError as err:
                if received:
                    result["cut_mid_stream"] = int(str(result["cut_mid_stream"])) + 1
                else:
                    failed.append(repr(err))

    try:
        await asyncio.gather(*(worker(w) for w in range(streams)))
    finally:
        await sdk.close()
    result["failed_before_first_byte"] = failed
    if record_gaps:
        result["gaps"] = [(round(t, 3), round(g, 4)) for t, g in gaps]
    return result


if __name__ == "__main__":
    url, name, count, duration = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    print(json.dumps(asyncio.run(main(url, name, count, duration, tokens, "--gaps" in sys.argv[6:]))), flush=True)
