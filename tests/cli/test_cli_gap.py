"""``placement-opt plan`` when the default search stops far from its bound: it says so and searches longer.

The solver is replaced by a fake returning hand-made plans, so the test sees exactly which time
limits the command asks for and what it prints.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from _cli import run_cli
from _plans import MACHINE, WORKLOAD, report_plan
from placement_opt.cli import main as cli_main

FAR = replace(report_plan(total_s=2.0), status="FEASIBLE", best_bound=0.86, gap=0.57, solve_time_s=1.0)
CLOSE = replace(report_plan(total_s=1.0), status="OPTIMAL", best_bound=0.999, gap=0.001, solve_time_s=2.5)


@pytest.fixture
def solver(monkeypatch):
    """A fake solve_strategy answering the given plans in turn; records each call's time limit."""
    calls: list[float | None] = []
    answers: list = []

    def fake(graph, machine, *, objective, workload, strategy, time_limit_s, source=None):
        calls.append(time_limit_s)
        return answers[len(calls) - 1]

    monkeypatch.setattr(cli_main, "_prepare", lambda *a, **k: (object(), MACHINE, WORKLOAD, None))
    monkeypatch.setattr(cli_main, "solve_strategy", fake)
    return calls, answers


def test_a_large_gap_searches_again_says_so_and_keeps_the_better_plan(solver):
    calls, answers = solver
    answers += [FAR, CLOSE]
    result = run_cli("plan", "tiny", "--devices", "cuda:0=a100-40gb")
    assert result.exit_code == 0, result.output
    assert calls == [None, cli_main.EXTRA_SEARCH_S]
    assert "gap 57.0% after the default 1.0 s search: searching again for up to 4 s" in result.output
    assert "OPTIMAL, objective 1.00 s" in result.output  # the second plan is shown
    assert "this is the second search's plan" in result.output
    assert "gap: not proven" not in result.output


def test_a_second_search_that_is_no_better_keeps_the_first_and_still_warns(solver):
    calls, answers = solver
    answers += [FAR, replace(FAR, objective_value=2.5, solve_time_s=4.0)]
    result = run_cli("plan", "tiny", "--devices", "cuda:0=a100-40gb")
    assert calls == [None, cli_main.EXTRA_SEARCH_S]
    assert "this is the first search's plan" in result.output
    assert "gap: not proven within 1% of the best" in result.output
    assert "--time-limit 5 on the command line" in result.output


@pytest.mark.parametrize("args, plan", [(("--time-limit", "1"), FAR), ((), CLOSE),
                                        ((), replace(FAR, gap=0.01))])
def test_no_second_search_with_a_time_limit_or_a_small_gap(solver, args, plan):
    calls, answers = solver
    answers.append(plan)
    result = run_cli("plan", "tiny", "--devices", "cuda:0=a100-40gb", *args)
    assert result.exit_code == 0, result.output
    assert calls == [float(args[1]) if args else None]
    assert "searching again" not in result.output
    assert ("gap: not proven" in result.output) == (plan.gap > 0.01)


def test_compare_names_the_gap_of_a_plan_far_from_its_bound():
    from placement_opt.cli.tables import why_lines
    from placement_opt.compare import StrategyOutcome

    lines = why_lines([StrategyOutcome(strategy="cpsat", plan=FAR),
                       StrategyOutcome(strategy="sequential", plan=report_plan(strategy="sequential")),
                       StrategyOutcome(strategy="balanced", plan=replace(FAR, gap=0.005))])
    assert len(lines) == 1
    assert lines[0].startswith("[bold yellow]cpsat gap[/]: not proven within 1% of the best")


@pytest.mark.parametrize("args", [(), ("--time-limit", "1")])
def test_compare_searches_the_cpsat_row_again_as_plan_does(solver, monkeypatch, args):
    """Without --time-limit, a cpsat plan left far from its bound is searched for longer and the better plan
    shown; the baselines are left as they are, and a time limit the user gives is the only search."""
    from placement_opt.compare import StrategyOutcome

    calls, answers = solver
    answers.append(CLOSE)
    baseline = StrategyOutcome(strategy="sequential", plan=report_plan(strategy="sequential"))
    monkeypatch.setattr(cli_main, "compare_strategies",
                        lambda *a, **k: [StrategyOutcome(strategy="cpsat", plan=FAR), baseline])
    graph = SimpleNamespace(meta=SimpleNamespace(dtype="float16"))  # compare's header names its dtype
    monkeypatch.setattr(cli_main, "_prepare", lambda *a, **k: (graph, MACHINE, WORKLOAD, "tiny"))
    monkeypatch.setattr(cli_main, "resolve_model", lambda model: None)  # accelerate's row is stubbed above
    result = run_cli("compare", "tiny", "--devices", "cuda:0=a100-40gb", *args)
    assert result.exit_code == 0, result.output
    if args:
        assert calls == [] and "searching again" not in result.output
        assert "cpsat gap" in result.output
    else:
        assert calls == [cli_main.EXTRA_SEARCH_S]
        assert "gap 57.0% after the default 1.0 s search: searching again for up to 4 s" in result.output
        assert "cpsat gap" not in result.output  # the second search's plan is proven close
