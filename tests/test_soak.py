"""The bounded soak (``python -m mini_infer.server.soak``, chapter 11), for about a minute: every
end check passes, and the mix reached the server (faults injected and seen by their clients)."""

from __future__ import annotations

import pytest

from mini_infer.server import soak

pytestmark = pytest.mark.timeout(600)


def test_a_one_minute_soak_passes_its_end_checks() -> None:
    seen, failures, figures = soak.run(seconds=60, seed=0, concurrency=4)
    print(soak.report(seen, failures, figures))
    assert failures == []
    assert seen.faults_fired >= 1 and seen.outcomes["fault", "error event"] == seen.faults_fired
    assert {kind for kind, _ in seen.outcomes} >= {"plain", "cancel", "fault", "oversized"}


def test_the_command_refuses_what_it_cannot_run() -> None:
    with pytest.raises(SystemExit):
        soak.main(["--seconds", "0"])
