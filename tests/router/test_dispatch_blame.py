"""Which side a failed attempt is counted against when both the prefill and the decode failed (``dispatch.blame``).

A dead prefill's decode stays alive and reports that it got no KV with an error event; when the router's event
loop sees both failures at once (a busy machine), the prefill must be blamed: its breaker opens, the healthy decode
keeps its score, and the retry is counted under ``prefill_``. A prefill that answered (with a 5xx) is alive: the
decode keeps the blame, as before."""

from __future__ import annotations

import pytest

from tandem_router.dispatch import Failure, blame, http_failure, transport_failure
from tandem_router.transport import WorkerError
from tandem_router.transport.errors import FailureReason

NO_KV = Failure("decode_stream_error", True, detail='data: {"error": {"message": "KV transfer failed"}}')


def _gone(side: str, reason: FailureReason) -> Failure:
    return transport_failure(side, WorkerError(reason, "x"))


@pytest.mark.parametrize("reason", [FailureReason.CLOSED, FailureReason.UNREACHABLE, FailureReason.READ_TIMEOUT])
def test_a_dead_prefill_explains_the_decode_reporting_no_kv(reason: FailureReason) -> None:
    prefill = _gone("prefill", reason)
    assert blame(prefill, NO_KV) is prefill


def test_a_prefill_that_answered_5xx_leaves_the_failure_with_the_decode() -> None:
    """Both alive, both reporting the transfer failed (e.g. a decode back under its old Mooncake session): blaming
    the prefill would open the breaker of every prefill the decode fails with (tests/test_recovery_local.py)."""
    assert blame(http_failure("prefill", 500, b"{}"), NO_KV) is NO_KV


@pytest.mark.parametrize("reason", [FailureReason.CLOSED, FailureReason.UNREACHABLE])
def test_a_decode_that_broke_itself_is_its_own_failure_whatever_the_prefill_did(reason: FailureReason) -> None:
    decode = _gone("decode", reason)
    assert blame(_gone("prefill", FailureReason.CLOSED), decode) is decode
    assert blame(http_failure("prefill", 500, b"{}"), decode) is decode


def test_a_decode_http_error_is_its_own_failure() -> None:
    decode = http_failure("decode", 503, b"")
    assert blame(http_failure("prefill", 500, b"{}"), decode) is decode


def test_the_decode_is_blamed_while_the_prefill_has_not_failed() -> None:
    assert blame(None, NO_KV) is NO_KV


def test_a_prefill_refusing_the_request_is_the_clients_error_not_the_pairs() -> None:
    refused = http_failure("prefill", 400, b'{"error": {"message": "bad"}}')
    assert refused.client_error
    assert blame(refused, _gone("decode", FailureReason.CLOSED)) is refused
    assert blame(refused, NO_KV) is refused


def test_a_decode_refusing_the_request_stays_the_answer() -> None:
    refused = Failure("decode_stream_error", False, 400, b'{"message": "bad"}')
    assert blame(_gone("prefill", FailureReason.CLOSED), refused) is refused
