"""Windows and budgets of the shared rate limiter (libs/podbay/ratelimit.py); its counting is tested against
PostgreSQL in tests/integration/test_ratelimit.py."""

from __future__ import annotations

import pytest

from podbay.ratelimit import SharedRateLimiter, window_of


def test_a_rate_becomes_a_window_and_a_budget() -> None:
    assert window_of(50.0) == (1, 50)
    assert window_of(2.5) == (1, 2)
    assert window_of(1.0) == (1, 1)
    assert window_of(0.5) == (2, 1)
    assert window_of(0.3) == (4, 1)
    with pytest.raises(ValueError):
        window_of(0)


def test_the_batch_is_a_tenth_of_the_budget_and_bounded() -> None:
    assert SharedRateLimiter(None, budget=50, window_s=1).batch == 5  # type: ignore[arg-type]
    assert SharedRateLimiter(None, budget=5, window_s=1).batch == 1  # type: ignore[arg-type]
    assert SharedRateLimiter(None, budget=10_000, window_s=1).batch == 64  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SharedRateLimiter(None, budget=5, window_s=1, batch=6)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SharedRateLimiter(None, budget=0, window_s=1)  # type: ignore[arg-type]
