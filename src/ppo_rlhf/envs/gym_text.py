"""gymnasium environments played by a language model (docs/agents.md, "Three ways to give an environment").

``--environment gym:ID`` takes an environment registered with gymnasium -- the ones ``ppo-rlhf
gym`` trains a policy network on -- whose actions are a discrete set, and lets a language model
play it in text: each observation is said in text -- by a function given with ``--observation-text
module:function``, else by ppo-rlhf's own words for gymnasium's text games (FrozenLake's and
Taxi's board with the positions said in words, Blackjack's hand), else by the environment's
``render_mode="ansi"`` with its terminal colour codes taken out -- the model answers in words, and
the first action name in its turn is the action taken::

    user:       Reach G. (the row's prompt)

                You are playing FrozenLake. Answer each turn with one action: left, down, right, up.
                SFFF
                FHFH ...
                You are at row 1, column 1.
    assistant:  down
    user:       ...

An environment that draws no text (CartPole: only pictures) and has no words of ppo-rlhf's needs
``--observation-text``; it is refused at start, saying so.

Action names come from the environment (``get_action_meanings()``), from the table below for
gymnasium's text games, or from ``--action-names``; an environment whose actions cannot be named
is refused at start.  A turn that names no action is answered with the allowed names and costs
a turn (``env/invalid_actions``); the environment does not step.

A row's columns named like the environment's constructor arguments configure that episode's
environment (FrozenLake's ``desc``: a map of the row's own), so training and held-out rows can
hold different maps.  Episodes are seeded from the run seed, the iteration and the row.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Callable

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.protocol import Adapter, describe

TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")  # the colour codes an ansi render marks things with

# Action names of gymnasium's toy-text environments, in their action order.
ACTION_NAMES = {
    "FrozenLake": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack": ["stick", "hit"],
}


def action_names_of(env, given: list[str] | None) -> list[str]:
    """The name of each of ``env``'s discrete actions; ConfigError when it has none to give."""
    from gymnasium import spaces

    space = env.action_space
    name = env.spec.id if env.spec is not None else describe(env.unwrapped)
    if not isinstance(space, spaces.Discrete):
        raise ConfigError(f"environment gym:{name}: its actions are a {type(space).__name__}, not a discrete set a "
                          f"language model can name; a text environment of your own (--environment module:Class, "
                          f"step(text)) can parse whatever its actions are")
    if given:
        names = given
    elif hasattr(env.unwrapped, "get_action_meanings"):
        names = [str(n).lower() for n in env.unwrapped.get_action_meanings()]
    else:
        names = next((v for k, v in ACTION_NAMES.items() if name.split("-")[0] == k), None)
    if names is None:
        raise ConfigError(f"environment gym:{name}: its {space.n} actions have no names ppo-rlhf knows; give them with "
                          f"--action-names (one word per action, in the action order)")
    if len(names) != space.n:
        raise ConfigError(f"environment gym:{name}: --action-names has {len(names)} names for {space.n} actions")
    if len(set(names)) != len(names):
        raise ConfigError(f"environment gym:{name}: the action names repeat ({', '.join(names)}); each must differ")
    return names


def family(env_id: str) -> str:
    """gymnasium's name of an environment without its version: FrozenLake-v1 -> FrozenLake."""
    return env_id.split("/")[-1].split("-")[0]


def frozen_lake_text(observation, env) -> str:
    """FrozenLake's board without colour codes (its ansi render marks the player only with them),
    and where the player is, in words."""
    desc = [[cell.decode() if isinstance(cell, bytes) else str(cell) for cell in row] for row in env.unwrapped.desc]
    unknown = sorted({cell for cells in desc for cell in cells} - set("SFHG"))
    if unknown:  # FrozenLake plays any other letter as frozen ice: the model would read a map it does not play
        raise ValueError(f"the map holds tiles FrozenLake does not know ({', '.join(unknown)}); its tiles are S "
                         f"(start), F (frozen), H (hole), G (goal)")
    row, column = divmod(int(observation), len(desc[0]))
    return "\n".join("".join(cells) for cells in desc) + f"\nYou are at row {row + 1}, column {column + 1}."


TAXI_PLACES = ["R", "G", "Y", "B"]


def taxi_text(observation, env) -> str:
    """Taxi's map without colour codes, and the taxi, the passenger and the destination in words."""
    taxi_row, taxi_column, passenger, destination = env.unwrapped.decode(int(observation))
    board = "\n".join(line.decode() if isinstance(line, bytes) else "".join(c.decode() for c in line)
                      for line in env.unwrapped.desc)
    waiting = "in the taxi" if passenger == 4 else f"waiting at {TAXI_PLACES[passenger]}"
    return (f"{board}\nThe taxi is at row {taxi_row + 1}, column {taxi_column + 1}; the passenger is {waiting}; "
            f"the destination is {TAXI_PLACES[destination]}.")


def blackjack_text(observation, env) -> str:
    """Blackjack's observation tuple (player's sum, dealer's card, usable ace) in words."""
    total, dealer, usable_ace = (int(value) for value in observation)
    ace = " (an ace counted as 11)" if usable_ace else ""
    shown = "an ace" if dealer == 1 else f"a {dealer}"
    return f"Your cards add up to {total}{ace}; the dealer shows {shown}."


# ppo-rlhf's words for gymnasium's text games, by family (--observation-text replaces them).
OBSERVATION_TEXT = {"FrozenLake": frozen_lake_text, "Taxi": taxi_text, "Blackjack": blackjack_text}


def entry_class(env_id: str):
    """The class ``gym.make(env_id)`` builds (its constructor arguments, its render modes)."""
    import gymnasium as gym

    entry = gym.spec(env_id).entry_point
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = getattr(importlib.import_module(module), attribute)
    return entry


def constructor_arguments(env_id: str) -> set[str]:
    """The keyword arguments ``gym.make(env_id, ...)`` passes to the environment's class."""
    return set(inspect.signature(entry_class(env_id)).parameters) - {"self", "render_mode"}


def draws_text(env_id: str) -> bool:
    """Whether the environment renders text (render_mode "ansi")."""
    return "ansi" in (getattr(entry_class(env_id), "metadata", None) or {}).get("render_modes", [])


def check_gym_id(env_id: str) -> None:
    """ConfigError at start for an id gymnasium does not know."""
    import gymnasium as gym

    try:
        gym.spec(env_id)
    except gym.error.Error as error:
        raise ConfigError(f"environment gym:{env_id}: {error}") from None


class GymActionEnvironment(Adapter):
    """A discrete gymnasium environment behind the text protocol (module docstring); ``instance``:
    the gymnasium environment (what reward functions get as ``environments``)."""

    observation_role = "user"
    prompt_separator = "\n\n"  # the instructions are a paragraph of their own after the row's prompt

    def __init__(self, env_id: str, make_kwargs: dict, action_names: list[str] | None = None,
                 observation_text: Callable | None = None, instructions: str | None = None):
        import gymnasium as gym

        self.env_id, self.make_kwargs = env_id, dict(make_kwargs)
        self.observation_text = observation_text or OBSERVATION_TEXT.get(family(env_id))
        self.render_mode = "ansi" if self.observation_text is None and draws_text(env_id) else None
        self.row_arguments = constructor_arguments(env_id)
        self.env_arguments = self.arguments({})
        self.env = self.make(self.env_arguments)
        self.name = f"gym:{env_id}"
        self.action_names = action_names_of(self.env, action_names)
        if self.observation_text is None and self.render_mode is None:
            modes = ", ".join(self.env.metadata.get("render_modes", [])) or "none"
            raise ConfigError(f"environment gym:{env_id} draws no text (its render modes: {modes}), and ppo-rlhf has "
                              f"no words for its observations; give --observation-text module:function, a function "
                              f"(observation, env) -> str saying each observation to the model")
        self.instructions = instructions or (f"You are playing {family(env_id)}. Answer each turn with one "
                                             f"action: {', '.join(self.action_names)}.")
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.action_names)) + r")\b", re.IGNORECASE)
        self.tool_stats: dict = {}
        self._gym = gym

    def arguments(self, row: dict) -> dict:
        """The environment's constructor arguments for ``row``: the run's, and the row's own where it names them."""
        return {**self.make_kwargs, **{k: v for k, v in row.items() if k in self.row_arguments}}

    @property
    def instance(self):
        return self.env

    def make(self, arguments: dict):
        import gymnasium as gym

        try:
            return gym.make(self.env_id, render_mode=self.render_mode, **arguments)
        except Exception as error:  # noqa: BLE001 -- gymnasium's constructor, named with what it was given
            raise ConfigError(f"environment gym:{self.env_id}: making it with {arguments or 'no arguments'} raised "
                              f"{type(error).__name__}: {error} (the arguments come from --environment-config and "
                              f"the row's columns named like the constructor's)") from None

    def text(self, observation) -> str:
        if self.observation_text is not None:
            text = self.observation_text(observation, self.env)
            if not isinstance(text, str):
                name = getattr(self.observation_text, "__qualname__", repr(self.observation_text))
                raise TypeError(f"its observation text function {name} returned {text!r:.60} "
                                f"({type(text).__name__}); it must return the text the model reads (--observation-text)")
            return text
        return TERMINAL_CODES.sub("", str(self.env.render())).strip("\n")

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        arguments = self.arguments(options or {})
        if arguments != self.env_arguments:  # this row's own map, or back to the run's (environments are pooled)
            self.env.close()
            self.env, self.env_arguments = self.make(arguments), arguments
        self.tool_stats = {"invalid_actions": 0}
        observation, info = self.env.reset(seed=seed)
        return f"{self.instructions}\n{self.text(observation)}", info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        match = self.pattern.search(action)
        if match is None:
            self.tool_stats["invalid_actions"] += 1
            return (f"That is not an action. Answer with one of: {', '.join(self.action_names)}.", 0.0, False, False,
                    {"invalid_action": True})
        index = [n.lower() for n in self.action_names].index(match.group(1).lower())
        observation, reward, terminated, truncated, info = self.env.step(index)
        return self.text(observation), float(reward), bool(terminated), bool(truncated), info

    def close(self) -> None:
        self.env.close()
