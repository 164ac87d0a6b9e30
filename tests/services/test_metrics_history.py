"""The server's own history of the series the console charts: a ring buffer of the last hour."""

import pytest

from hmi.services.metrics import CHARTED, History, Metrics


def test_the_history_keeps_the_last_hour_of_the_charted_series_and_forgets_the_rest():
    metrics = Metrics()
    history = History(interval_s=10.0)
    for i in range(400):  # 4,000 s of samples: the first 40 fall out of the hour
        metrics.requests.labels("/v1/tenants/{tenant}/infer", "200").inc()
        metrics.queue_depth.set(i)  # a gauge the console does not chart: not kept
        history.record(metrics, {"fine-tune reviews": i / 400} if i % 2 else {}, t=1000.0 + 10 * i)
    out = history.as_json()
    assert out["interval_s"] == 10.0 and len(out["samples"]) == 360
    first, last = out["samples"][0], out["samples"][-1]
    assert first["t"] == 1400.0 and last["t"] == 4990.0
    assert {name for name, _, _ in last["metrics"]} <= set(CHARTED)
    counts = [v for name, labels, v in last["metrics"] if name == "hmi_http_requests_total"]
    assert counts == [400.0] and last["jobs"] == {"fine-tune reviews": 399 / 400}


def test_a_history_interval_of_zero_is_refused():
    with pytest.raises(ValueError, match="above 0"):
        History(interval_s=0)
