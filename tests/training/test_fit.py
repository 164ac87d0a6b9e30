import pytest
import torch

from hmi.training.fit import Cancelled, Fit, early_stopping, head_groups


def _quadratic():
    w = torch.nn.Parameter(torch.tensor([3.0]))
    return w, lambda: ((w - 1.0) ** 2).sum()


def test_fit_steps_adamw_reports_progress_and_clips():
    w, loss = _quadratic()
    seen = []
    with Fit([w], 4, lr=0.5, clip=1e-3, progress=False, on_progress=lambda f, info: seen.append((f, info)),
             report_every=2) as fit:
        while not fit.done:
            fit.step(loss(), {"epoch": 1})
    assert fit.step_count == 4 and w.item() < 3.0
    assert [f for f, _ in seen] == [0.5, 1.0] and seen[0][1]["epoch"] == 1 and "loss" in seen[0][1]


def test_fit_matches_a_plain_adamw_loop_step_for_step():
    w, loss = _quadratic()
    ref = torch.nn.Parameter(torch.tensor([3.0]))
    opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01)
    with Fit([w], 5, lr=0.1, weight_decay=0.01, progress=False) as fit:
        for _ in range(5):
            fit.step(loss())
            opt.zero_grad()
            ((ref - 1.0) ** 2).sum().backward()
            opt.step()
    assert torch.equal(w.detach(), ref.detach())


def test_a_head_of_its_own_rate_steps_as_a_second_adamw_at_that_rate_and_is_clipped_with_the_body():
    """``head_groups``: AdamW is per parameter, so the body at the fit's rate and the head at its own
    are two plain AdamW loops, step for step; clipping takes the norm over both groups together."""
    body, head = torch.nn.Parameter(torch.tensor([3.0, -2.0])), torch.nn.Parameter(torch.tensor([0.5]))
    ref_b, ref_h = (torch.nn.Parameter(t.detach().clone()) for t in (body, head))
    opts = [torch.optim.AdamW([ref_b], lr=0.1, weight_decay=0.01), torch.optim.AdamW([ref_h], lr=0.7, weight_decay=0.01)]
    assert head_groups([body], [head], None) == [body, head]

    def loss(b, h):
        return ((b - 1.0) ** 2).sum() + ((h + 2.0) ** 2).sum()

    with Fit(head_groups([body], [head], 0.7), 5, lr=0.1, weight_decay=0.01, progress=False) as fit:
        for _ in range(5):
            fit.step(loss(body, head))
            for o in opts:
                o.zero_grad()
            loss(ref_b, ref_h).backward()
            for o in opts:
                o.step()
    assert torch.equal(body.detach(), ref_b.detach()) and torch.equal(head.detach(), ref_h.detach())
    grads = []
    clipped = Fit(head_groups([body], [head], 0.7), 1, lr=0.1, clip=1e-3, progress=False)
    clipped.opt.step = lambda: grads.extend(p.grad.clone() for p in clipped.params)
    clipped.step(loss(body, head))
    assert abs(float(torch.cat(grads).norm()) - 1e-3) < 1e-9


def test_a_cancelled_fit_raises_before_the_next_step():
    w, loss = _quadratic()
    stop = []
    with Fit([w], 10, lr=0.1, progress=False, should_stop=lambda: bool(stop)) as fit:
        fit.check()
        fit.step(loss())
        stop.append(1)
        with pytest.raises(Cancelled):
            fit.check()
    assert fit.step_count == 1


def test_early_stopping_keeps_the_best_epoch_and_stops_after_patience():
    scores = iter([0.5, 0.7, 0.6, 0.65, 0.9])
    ran = []

    def run_epoch(epoch):
        ran.append(epoch)
        return {"score": next(scores)}

    best, state, history = early_stopping(5, 2, run_epoch, lambda r: r["score"], lambda: {"epoch": ran[-1]})
    assert (best, state, ran) == (0.7, {"epoch": 1}, [0, 1, 2, 3])
    assert [r["score"] for r in history] == [0.5, 0.7, 0.6, 0.65]


def test_fit_resumes_from_its_state_dict():
    w, loss = _quadratic()
    with Fit([w], 6, lr=0.1, progress=False, schedule=lambda s: 1.0 / (s + 1)) as a:
        for _ in range(3):
            a.step(loss())
        state = a.state_dict()
    w2 = torch.nn.Parameter(w.detach().clone())
    with Fit([w2], 6, lr=0.1, progress=False, schedule=lambda s: 1.0 / (s + 1)) as b:
        b.load_state_dict(state)
        assert b.step_count == 3 and b.sched.last_epoch == 3
