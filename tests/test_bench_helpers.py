"""The pure helpers of the benchmarks (benchmarks/common.py's figures of a run,
agents_tools.py, agents_http.py, distill_teacher.py's worked solutions, agents_strategy.py's
games), on hand-made rows (the benchmarks themselves run for half an hour and more, and are not
tests)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import curve, first_reaching, mean_curve, spread  # noqa: E402

ROWS = [{"step": 0, "eval/exact_match": 0.3},
        {"step": 1, "time/elapsed": 2.0, "time/iteration": 2.0},
        {"step": 2, "time/elapsed": 4.0, "time/iteration": 2.0, "eval/exact_match": 0.96},
        {"step": 3, "time/elapsed": 6.5, "time/iteration": 2.5, "eval/exact_match": 0.995}]


def test_seconds_to_a_threshold_are_those_of_the_first_evaluation_reaching_it():
    assert first_reaching(ROWS, "eval/exact_match", 0.95) == 4.0
    assert first_reaching(ROWS, "eval/exact_match", 0.99) == 6.5
    assert first_reaching(ROWS, "eval/exact_match", 0.999) is None


def test_a_curve_starts_at_zero_seconds_with_the_evaluation_before_ppo():
    assert curve(ROWS, "eval/exact_match") == [(0.0, 0.3), (4.0, 0.96), (6.5, 0.995)]


def test_seeds_are_averaged_point_by_point_over_their_common_length():
    runs = [{"curve:k": [(0.0, 0.2), (2.0, 0.6)]}, {"curve:k": [(0.0, 0.4), (4.0, 0.8), (6.0, 0.9)]}]
    assert mean_curve(runs, "k") == [(0.0, 0.30000000000000004), (3.0, 0.7)]


def test_spread_gives_mean_and_range_and_counts_seeds_that_never_reached():
    assert spread([0.5, 0.7, 0.9], 100, 1, "%") == "70.0% (50.0-90.0)"
    assert spread([4.0]) == "4.0"
    assert spread([None, 3.0, 5.0]) == "2/3 seeds (3.0-5.0)"
    assert spread([None]) == "0/1 seeds"


def test_the_calculator_environment_class_offers_the_plain_tools_schema():
    """``peers-env``'s class lists the same tool as ``tools``' function (so the prompts render as the
    SFT warm-up's did) and nothing else: TRL's rule (every public method but reset / get_reward)."""
    import agents_tools

    from ppo_rlhf.envs.tools import tool_schema
    from ppo_rlhf.envs.trl import tool_methods

    methods = tool_methods(agents_tools.CalculatorEnv())
    assert [method.__name__ for method in methods] == ["calculator"]
    assert tool_schema(methods[0]) == tool_schema(agents_tools.calculator)


def test_the_calculator_environment_class_plays_as_trl_shape_and_records_each_episode():
    """Named as the benchmark names it (--environment FILE:CalculatorEnv): TRL's shape; reset gets
    the row's columns, the model's call is answered by the class, which records it; the next
    episode starts with an empty record."""
    import agents_tools
    from bench_agents import ENVIRONMENT

    from ppo_rlhf.envs import environment_source

    source = environment_source(ENVIRONMENT)
    assert "TRL's environment_factory shape" in source.description and not source.pays
    environment = source.environments(1)[0]
    row = agents_tools.prompt_rows([(347, 29)])[0]
    assert source.calls.run(environment.reset(seed=0, options=row)) == (None, {})  # awaited on the run's loop
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>'
    answers, reward, done, _, _ = environment.step(call)
    assert [message["content"] for message in answers] == ["10063"] and not done
    assert environment.instance.computed == [("347 * 29", "10063")]
    assert environment.step("The answer is 10063.")[2]  # no call: the episode's answer
    source.calls.run(environment.reset(seed=0, options=row))
    assert environment.instance.computed == []


def test_the_http_calculator_answers_as_the_local_one_through_both_clients(monkeypatch):
    """benchmarks/agents_http.py: the latency benchmark's tool gives the calculator's answers and
    errors, through the sync client and the async one, with the calculator's own schema."""
    import asyncio

    import pytest
    from transformers.utils import get_json_schema

    import agents_http
    import agents_http_async
    import agents_tools

    with agents_http.LatencyServer(0.01) as server:
        monkeypatch.setenv(agents_http.URL_VARIABLE, server.url)
        assert agents_http.calculator("347 * 29") == agents_tools.calculator("347 * 29") == "10063"
        assert asyncio.run(agents_http_async.calculator("(2 + 3) / 4")) == "1.25"
        for client in (agents_http.calculator, lambda e: asyncio.run(agents_http_async.calculator(e))):
            with pytest.raises(ValueError, match="SyntaxError"):  # as the local calculator raises
                client("import os")
        assert server.requests == 4
    schema = get_json_schema(agents_tools.calculator)
    assert get_json_schema(agents_http.calculator) == get_json_schema(agents_http_async.calculator) == schema


def test_the_latency_servers_waiting_seconds_are_the_union_of_its_calls_waits(monkeypatch):
    """Calls one after another add their waits; calls at once count once (hand-worked intervals)."""
    import agents_http

    server = agents_http.LatencyServer(0.0)
    server.intervals = [(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (0.6, 0.9), (4.0, 4.5)]
    assert server.waiting_seconds() == 3.5  # [0, 2] + [3, 4.5]
    server.http.server_close()
    with agents_http.LatencyServer(0.05) as served:
        monkeypatch.setenv(agents_http.URL_VARIABLE, served.url)
        agents_http.calculator("1 + 1")
        agents_http.calculator("2 + 2")
    assert served.requests == 2 and served.waiting_seconds() >= 0.1  # one after another: both waits count


def test_the_lake_walk_keeps_the_rules_and_stops_at_the_goal():
    """``lake_walk`` (the rules-only warm-up's traces): every move steps onto ice or the goal, the
    walk ends at the goal or after ``turns`` moves, and one seed draws one walk."""
    import random

    import agents_tools

    corridor = ["SHHH", "FHHH", "FHHH", "FFFG"]  # one way only: down 3, right 3 (or back up)
    walk = agents_tools.lake_walk(corridor, random.Random(0), turns=40)
    row, column = 0, 0
    for move in walk:
        row, column = row + agents_tools.LAKE_MOVES[move][0], column + agents_tools.LAKE_MOVES[move][1]
        assert 0 <= row < 4 and 0 <= column < 4 and corridor[row][column] != "H"
    assert (row, column) == (3, 3) and len(walk) >= 6
    assert agents_tools.lake_walk(corridor, random.Random(1), turns=2) in (["down", "down"], ["down", "up"])
    open_lake = ["SFFF", "FFFF", "FFFF", "FFFG"]
    walks = [agents_tools.lake_walk(open_lake, random.Random(seed)) for seed in range(40)]
    assert walks[3] == agents_tools.lake_walk(open_lake, random.Random(3))
    assert {walk[0] for walk in walks} == {"down", "right"}  # left and up are edges at the start
    assert all(len(walk) == 8 or walk.count("down") - walk.count("up") == 3 for walk in walks)


def test_the_safe_view_lists_the_moves_onto_ice_or_the_goal():
    """``lake_safe_view`` (--view safe) names the moves that neither fall nor bump an edge, in the
    order ``lake_view`` gives each side; both say where the player and the goal are alike."""
    import agents_tools
    import gymnasium as gym

    lake = gym.make("FrozenLake-v1", is_slippery=False, desc=["SFFF", "HFFF", "FFFH", "FFHG"])
    observation, _ = lake.reset(seed=0)
    assert agents_tools.lake_safe_view(observation, lake) == \
        "You are at row 1, column 1; the goal is 3 down and 3 right. Safe moves: right."
    assert agents_tools.lake_view(observation, lake) == ("You are at row 1, column 1; the goal is 3 down and 3 "
                                                        "right. left: edge, down: hole, right: ice, up: edge.")
    for move in (2, 2, 1, 1):  # right, right, down, down: row 3, column 3, holes below and to the right
        observation, *_ = lake.step(move)
    assert agents_tools.lake_safe_view(observation, lake).endswith("1 down and 1 right. Safe moves: left, up.")
    open_lake = gym.make("FrozenLake-v1", is_slippery=False, desc=["SFFF", "FFFF", "FFFF", "FFFG"])
    open_lake.reset(seed=0)
    for move in (1, 1, 1, 2, 2):  # down x3, right x2: the goal to the right, the edge below
        observation, *_ = open_lake.step(move)
    assert agents_tools.lake_safe_view(observation, open_lake).endswith("Safe moves: left, right, up.")


def test_a_walk_trace_ends_on_the_models_move_and_reads_as_its_view():
    """An SFT row must end with the reply to learn: a walk that runs out of moves leaves a board
    after its last move, which ``lake_trace`` drops; a shortest path ends on its move into the goal."""
    import random

    import agents_tools

    open_lake = {"prompt": "Play.", "desc": ["SFFF", "FFFF", "FFFF", "FFFG"]}
    walk = agents_tools.lake_walk(open_lake["desc"], random.Random(0))
    assert len(walk) == 8  # out of moves, short of the goal: a board would follow its last move
    messages = agents_tools.lake_trace(open_lake, walk_seed=0, view=agents_tools.lake_safe_view)["messages"]
    assert messages[-1]["role"] == "assistant"
    assert [m["content"] for m in messages if m["role"] == "assistant"] == walk
    assert "Safe moves: down, right." in messages[0]["content"]
    shortest = agents_tools.lake_trace(open_lake)["messages"]  # the first board, then 6 moves with 5 boards between
    assert shortest[-1]["role"] == "assistant" and len(shortest) == 1 + 6 + 5


def test_a_worked_solution_walks_the_terms_by_place_value_and_checks_the_answer():
    import pytest

    from distill_teacher import place_values, worked_solution

    assert place_values(305) == [300, 5] and place_values(40) == [40] and place_values(0) == [0]
    assert worked_solution("15 - 43", "-28") == ("Start at 15. Subtract 43: 15 - 40 = -25, -25 - 3 = -28. "
                                                 "<answer>-28</answer>")
    assert worked_solution("90 + 7 - 305", "-208") == ("Start at 90. Add 7: 90 + 7 = 97. Subtract 305: "
                                                       "97 - 300 = -203, -203 - 5 = -208. <answer>-208</answer>")
    with pytest.raises(ValueError, match="works out to 3"):
        worked_solution("4 - 1", "5")  # a solution that would teach a wrong answer is never written
    with pytest.raises(ValueError, match="not a chain of sums"):
        worked_solution("4 * 1", "4")


def test_the_number_game_answers_higher_or_lower_and_ends_after_five_guesses_or_the_find():
    from agents_strategy import GuessNumber

    game = GuessNumber()
    game.reset(secret=20)
    assert [game.guess(n) for n in (16, 24, 20)] == ["Higher.", "Lower.", "Correct!"]
    assert game.guess(7) == "The game is over." and game.get_reward() == 1.0
    game.reset(secret=1)
    answers = [game.guess(n) for n in (2, 3, 4, 5, "six", 6, 1)]
    # "six" is not a guess: it costs nothing; the fifth counted guess ends the game, unfound
    assert answers == ["Lower.", "Lower.", "Lower.", "Lower.", "'six' is not a whole number.",
                       "Lower. No guesses left.", "The game is over."]
    assert game.get_reward() == 0.0


def test_the_door_takes_keys_on_the_ring_only_and_opens_for_its_own():
    from agents_strategy import DoorKeys

    game = DoorKeys()
    game.reset(keys=["iron", "gold", "tin"], key="gold")
    assert game.try_key("brass") == "There is no brass key on your ring."  # not a try
    assert game.try_key("iron") == "It does not turn."
    assert game.try_key("Gold key") == "It turns: the door is open!"
    assert game.try_key("tin") == "The game is over." and game.get_reward() == 1.0 and game.tries == 2


def test_random_legal_play_keeps_the_rules_and_wins_about_as_often_as_worked_out():
    import random

    from agents_strategy import keys_random_tries, keys_rows, number_random_guesses, simulate

    rng = random.Random(0)
    for secret in (1, 16, 31):
        guesses, low, high = number_random_guesses(secret, rng), 1, 31
        for guess in guesses:  # every guess within what the answers so far allow
            assert low <= guess <= high
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1) if secret < guess else (low, high)
        assert len(guesses) <= 5 and (guesses[-1] == secret or len(guesses) == 5)
    row = keys_rows(1, seed=3)[0]
    tries = keys_random_tries(row["keys"], row["key"], rng)
    assert set(tries) <= set(row["keys"]) and (tries[-1] == row["key"] or len(tries) == 5)
    # Keys at random: 1 - (5/6)^5 = 0.598 wins.  The number game's 54% is only simulated: a band.
    rates = simulate(games=4000, seed=0)
    assert abs(rates["keys: random legal tries"] - (1 - (5 / 6) ** 5)) < 0.03
    assert 0.50 < rates["number: random legal guesses"] < 0.58


def test_a_warm_up_trace_is_a_trl_conversation_whose_tool_answers_are_the_games():
    import json
    import random

    from agents_strategy import DoorKeys, keys_rows, keys_trace

    row = keys_rows(1, seed=5)[0]
    schema = {"type": "function", "function": {"name": "try_key"}}
    trace = keys_trace(row, random.Random(1), schema)
    messages = trace["messages"]
    assert trace["tools"] == [schema] and messages[0] == {"role": "user", "content": row["prompt"]}
    game = DoorKeys()
    game.reset(**row)
    for call, answer in zip(messages[1:-1:2], messages[2:-1:2]):
        key = json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["key"]
        assert answer == {"role": "tool", "name": "try_key", "content": game.try_key(key)}
    assert messages[-1]["role"] == "assistant" and "<tool_call>" not in messages[-1]["content"]
    assert messages[-1]["content"].startswith("The door is open" if game.open else "I did not open the door")


def test_a_played_game_is_replayed_into_where_it_was_lost():
    from agents_strategy import fault_shares, faults

    keys = {"keys": ["iron", "gold", "tin"], "key": "gold"}
    call = lambda move, result: {"arguments": {"key": move}, "result": result}
    # A key off the ring (refused), iron twice (the second wasted), then it stops with tries left.
    stopped = faults(keys, [call("brass", "There is no brass key on your ring."), call("iron", "It does not turn."),
                            call("Iron key", "It does not turn.")], won=False, truncated=False)
    assert stopped == {"refused": 1, "wasted": 1, "after_over": 0, "lost": "stopped"}
    won = faults(keys, [call("gold", "It turns: the door is open!"), call("tin", "The game is over.")],
                 won=True, truncated=False)
    assert won == {"refused": 0, "wasted": 0, "after_over": 1, "lost": None}
    number = {"secret": 20}
    guess = lambda n, result: {"arguments": {"number": n}, "result": result}
    # 16: higher, so 1-16 are ruled out; 10 wastes a guess; 5 guesses used, lost.
    played_out = faults(number, [guess(16, "Higher."), guess(10, "Higher."), guess(24, "Lower."), guess(22, "Lower."),
                                 guess(21, "Lower. No guesses left.")], won=False, truncated=False)
    assert played_out == {"refused": 0, "wasted": 1, "after_over": 0, "lost": "played out"}
    cut = faults(number, [guess("x", "'x' is not a whole number.")], won=False, truncated=True)
    assert cut["lost"] == "cut" and cut["refused"] == 1
    shares = fault_shares([stopped, won, played_out, cut])
    assert shares["won"] + sum(shares[f"lost: {way}"] for way in ("cut", "stopped", "played out")) == 1.0
    assert shares["refused"] == 0.5 and shares["wasted"] == 0.5 and shares["lost: stopped"] == 0.25
