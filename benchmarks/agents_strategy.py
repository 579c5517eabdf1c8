"""Games where a strategy across turns wins (issue 62; benchmarks/bench_strategy.py), each a TRL
``environment_factory`` class with one tool: the tool's answers are information, and the episode
pays 1 (``get_reward``) only if the goal is reached within a few calls.  The observations are what
a person running the game would say -- no hint of the strategy is written into them.

``GuessNumber``: a whole number from 1 to 31, five guesses, each answered "higher" or "lower".
Halving what is left (binary search) always wins; a guess drawn at random among the numbers the
answers so far allow wins 54% of games (simulated: ``simulate``).

``DoorKeys``: a door, a ring of six keys (named differently in every game, in a drawn order), one of
which turns, five tries.  Trying each key at most once wins 5 games in 6 (83%); a key drawn at
random from the ring at every try -- repeats and all -- wins 60%.

The warm-up's traces (``number_trace``, ``keys_trace``) play each game by those random rules: they
keep its format (the tool call, the final answer, no call after the game is over) and its rules (a
guess the answers allow, a key on the ring) and not the strategy.
"""

from __future__ import annotations

import json
import random

# ---------------------------------------------------------------- the number game
NUMBER_TOP, NUMBER_GUESSES = 31, 5
NUMBER_PROMPT = (f"I am thinking of a whole number from 1 to {NUMBER_TOP}. Find it with the guess tool: after each "
                 f"guess I say whether my number is higher or lower. You have {NUMBER_GUESSES} guesses. When you "
                 f"have found it, or have no guesses left, answer without calling the tool.")


class GuessNumber:
    """The number game as a TRL ``environment_factory`` class: ``reset(secret=)`` from the row, the
    tool ``guess``, ``get_reward()`` 1 once the number was guessed within the guesses allowed."""

    def reset(self, secret: int, **kwargs) -> None:
        self.secret, self.guesses, self.found = int(secret), 0, False

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: the guess
        """
        if self.found or self.guesses >= NUMBER_GUESSES:
            return "The game is over."
        try:
            number = int(number)
        except (TypeError, ValueError):
            return f"{number!r} is not a whole number."
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "Correct!"
        answer = "Higher." if self.secret > number else "Lower."
        return answer + (" No guesses left." if self.guesses == NUMBER_GUESSES else "")

    def get_reward(self) -> float:
        return float(self.found)


def number_rows(secrets) -> list[dict]:
    return [{"prompt": NUMBER_PROMPT, "secret": secret} for secret in secrets]


def number_random_guesses(secret: int, rng: random.Random) -> list[int]:
    """A game played by random legal guesses: each drawn uniformly among the numbers the answers so
    far allow, until it is found or the guesses run out."""
    low, high, guesses = 1, NUMBER_TOP, []
    while len(guesses) < NUMBER_GUESSES:
        guesses.append(rng.randint(low, high))
        if guesses[-1] == secret:
            break
        low, high = (guesses[-1] + 1, high) if secret > guesses[-1] else (low, guesses[-1] - 1)
    return guesses


# ---------------------------------------------------------------- the door and its keys
KEY_NAMES = ("brass", "iron", "silver", "gold", "copper", "bronze", "steel", "tin", "red", "blue", "green", "black",
             "white", "small", "long", "rusty", "bent", "old", "round", "square")
KEYS_ON_RING, KEY_TRIES = 6, 5


def keys_prompt(keys: list[str]) -> str:
    return (f"A door is locked. Your ring holds {len(keys)} keys: {', '.join(keys)}. One of them opens the door. "
            f"Try keys with the try_key tool; you have {KEY_TRIES} tries. When the door is open, or you have no "
            f"tries left, answer without calling the tool.")


class DoorKeys:
    """The door game as a TRL ``environment_factory`` class: ``reset(keys=, key=)`` from the row,
    the tool ``try_key``, ``get_reward()`` 1 once the door was opened within the tries allowed."""

    def reset(self, keys: list[str], key: str, **kwargs) -> None:
        self.keys, self.key, self.tries, self.open = list(keys), key, 0, False

    def try_key(self, key: str) -> str:
        """Try a key in the lock.

        Args:
            key: the key's name
        """
        if self.open or self.tries >= KEY_TRIES:
            return "The game is over."
        name = str(key).strip().lower().removesuffix(" key")
        if name not in self.keys:
            return f"There is no {key} key on your ring."
        self.tries += 1
        if name == self.key:
            self.open = True
            return "It turns: the door is open!"
        return "It does not turn." + (" No tries left." if self.tries == KEY_TRIES else "")

    def get_reward(self) -> float:
        return float(self.open)


def keys_rows(count: int, seed: int, exclude: set | None = None) -> list[dict]:
    """``count`` games (a ring of KEYS_ON_RING names drawn from KEY_NAMES in a drawn order, and the
    key that turns), none of ``exclude`` (rings as tuples)."""
    rng, rows, seen = random.Random(seed), [], set(exclude or ())
    while len(rows) < count:
        keys = rng.sample(KEY_NAMES, KEYS_ON_RING)
        if tuple(keys) in seen:
            continue
        seen.add(tuple(keys))
        rows.append({"prompt": keys_prompt(keys), "keys": keys, "key": rng.choice(keys)})
    return rows


def keys_random_tries(keys: list[str], key: str, rng: random.Random) -> list[str]:
    """A game played by random legal tries: each a key drawn uniformly from the ring (a key tried
    before may come again), until the door opens or the tries run out."""
    tries = []
    while len(tries) < KEY_TRIES and (not tries or tries[-1] != key):
        tries.append(rng.choice(keys))
    return tries


# ---------------------------------------------------------------- the warm-up's traces
def tool_call(name: str, arguments: dict) -> str:
    """A call as chatml_tools.jinja writes one (Hermes' <tool_call>), which the run's parser reads."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def played(prompt: str, tool: str, argument: str, moves: list, answer_of, environment, closing: str, schema) -> dict:
    """An SFT row of TRL's conversational format (its ``tools`` column): the prompt, each move as a
    call and the environment's answer to it, then the final answer without a call."""
    messages = [{"role": "user", "content": prompt}]
    for move in moves:
        messages += [{"role": "assistant", "content": tool_call(tool, {argument: move})},
                     {"role": "tool", "name": tool, "content": answer_of(environment, move)}]
    messages.append({"role": "assistant", "content": closing})
    return {"messages": messages, "tools": [schema]}


def number_trace(row: dict, rng: random.Random, schema: dict) -> dict:
    game = GuessNumber()
    game.reset(**row)
    guesses = number_random_guesses(row["secret"], rng)
    closing = (f"I found it: your number is {row['secret']}." if guesses[-1] == row["secret"] else
               f"I did not find your number in {NUMBER_GUESSES} guesses.")
    return played(row["prompt"], "guess", "number", guesses, GuessNumber.guess, game, closing, schema)


def keys_trace(row: dict, rng: random.Random, schema: dict) -> dict:
    game = DoorKeys()
    game.reset(**row)
    tries = keys_random_tries(row["keys"], row["key"], rng)
    closing = (f"The door is open: the {row['key']} key turns." if tries[-1] == row["key"] else
               f"I did not open the door in {KEY_TRIES} tries.")
    return played(row["prompt"], "try_key", "key", tries, DoorKeys.try_key, game, closing, schema)


# ---------------------------------------------------------------- where a game was lost
LOSSES = ("cut", "stopped", "played out")


def faults(row: dict, calls: list[dict], won: bool, truncated: bool) -> dict:
    """What one played game did, replayed from its tool calls (each ``{"arguments", "result"}``, as
    a rollout records them) on its row: ``refused`` calls the game did not take (a key not on the
    ring, a guess that is not a number), ``wasted`` moves it took that could not win (a key tried
    before; a number the answers had already ruled out), ``after_over`` calls once the game was
    decided, and for a lost game where it was lost: ``cut`` by the turn limit, ``stopped`` (answered
    with moves left), or ``played out`` (every move used).  Refused, cut and stopped are the rules
    the warm-up's traces keep; wasted moves in a game played out are the strategy they do not."""
    count = {"refused": 0, "wasted": 0, "after_over": 0}
    moves, low, high, tried = 0, 1, NUMBER_TOP, set()
    limit = KEY_TRIES if "keys" in row else NUMBER_GUESSES
    for call in calls:
        result = str(call.get("result", ""))
        if result.startswith("The game is over"):
            count["after_over"] += 1
        elif result.startswith("There is no") or result.endswith("is not a whole number."):
            count["refused"] += 1
        else:
            moves += 1
            move = next(iter(call.get("arguments", {}).values()), None)
            if "keys" in row:
                name = str(move).strip().lower().removesuffix(" key")
                count["wasted"] += name in tried
                tried.add(name)
            else:
                number = int(move)
                count["wasted"] += not low <= number <= high
                low, high = ((max(low, number + 1), high) if result.startswith("Higher") else
                             (low, min(high, number - 1)) if result.startswith("Lower") else (low, high))
    lost = None if won else "cut" if truncated else "stopped" if moves < limit else "played out"
    return {**count, "lost": lost}


def fault_shares(games: list[dict]) -> dict[str, float]:
    """``faults`` over many games: each count per game, and each way of losing as a share of all
    games (so won + cut + stopped + played out = 1)."""
    count = max(len(games), 1)
    shares = {key: sum(game[key] for game in games) / count for key in ("refused", "wasted", "after_over")}
    shares["won"] = sum(game["lost"] is None for game in games) / count
    shares.update({f"lost: {way}": sum(game["lost"] == way for game in games) / count for way in LOSSES})
    return shares


def simulate(games: int = 20000, seed: int = 0) -> dict[str, float]:
    """Each game's success rate played by the warm-up's random rules and by the strategy."""
    rng, wins = random.Random(seed), 0
    for _ in range(games):
        secret = rng.randint(1, NUMBER_TOP)
        wins += number_random_guesses(secret, rng)[-1] == secret
    number = wins / games
    keys = sum(keys_random_tries(row["keys"], row["key"], rng)[-1] == row["key"]
               for row in keys_rows(games, seed)) / games
    return {"number: random legal guesses": number, "number: binary search": 1.0,
            "keys: random legal tries": keys, "keys: each key once": KEY_TRIES / KEYS_ON_RING}
