"""A run that makes the policy worse on its held-out prompts says so (evaluation.fell_below_start,
PPOLoop.evaluate_if_due): a drop the held-out set can tell from its noise, by hand."""

from types import SimpleNamespace

from ppo_rlhf.evaluation import fell_below_start
from ppo_rlhf.trainers.ppo_loop import PPOLoop, Progress


def test_a_fall_counts_where_it_is_more_than_two_standard_errors_of_the_difference():
    # 0.45 -> 0.20 on 64 games: sqrt((0.45 x 0.55 + 0.2 x 0.8) / 64) = 0.0798; the drop 0.25 > 0.160.
    assert fell_below_start({"eval/episode/success": 0.45}, {"eval/episode/success": 0.20}, 64) == \
        ("eval/episode/success", 0.45, 0.20)
    # 0.219 -> 0.188 on 32: 2 x sqrt((0.171 + 0.153) / 32) = 0.201 > the drop 0.031: noise.
    assert fell_below_start({"eval/episode/success": 0.219}, {"eval/episode/success": 0.188}, 32) is None
    # The same drop on 2,000 prompts: 2 x 0.0127 = 0.025 < 0.031, a fall.
    assert fell_below_start({"eval/accuracy": 0.219}, {"eval/accuracy": 0.188}, 2000) is not None
    assert fell_below_start({"eval/accuracy": 0.2}, {"eval/accuracy": 0.9}, 10) is None  # a rise
    # The first rate of HEADLINE_RATES judges; a score that is not a rate never does.
    assert fell_below_start({"eval/exact_match": 0.5, "eval/episode/success": 0.9},
                            {"eval/exact_match": 0.5, "eval/episode/success": 0.1}, 100) is None
    assert fell_below_start({"eval/score": 3.0}, {"eval/score": -3.0}, 100) is None


def test_the_loop_warns_and_the_summary_keeps_each_fall(capsys):
    results = iter([({"eval/episode/success": 0.5}, []), ({"eval/episode/success": 0.05}, [])])
    loop = SimpleNamespace(config=SimpleNamespace(eval_every=1, iterations=2),
                           evaluator=SimpleNamespace(prompts=["p"] * 40), evaluate=lambda: next(results))
    progress = Progress(before={"eval/episode/success": 0.45})
    PPOLoop.evaluate_if_due(loop, 1, {}, progress)  # 0.45 -> 0.5: nothing said
    assert progress.below_start == [] and "warning" not in capsys.readouterr().out
    PPOLoop.evaluate_if_due(loop, 2, {}, progress)
    assert progress.below_start == [[2, "eval/episode/success", 0.45, 0.05]]
    said = capsys.readouterr().out
    assert "warning: held-out eval/episode/success 0.45 at the start, 0.05 after iteration 2" in said
    assert Progress(**progress.saved()).below_start == progress.below_start  # carried over a resume
