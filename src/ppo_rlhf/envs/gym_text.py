"""gymnasium environments played by a language model (docs/agents.md, "Three ways to give an environment").

``--environment gym:ID`` takes an environment registered with gymnasium -- the ones ``ppo-rlhf
gym`` trains a policy network on -- whose actions are a discrete set, and lets a language model
play it in text: each observation is rendered as text (the environment's ``render_mode="ansi"``,
or a function given with ``--observation-text module:function``), the model answers in words,
and the first action name in its turn is the action taken::

    user:       Move to the goal G without falling into a hole H. ... Actions: left, down, right, up.
                SFFF
                F(H)FH ...
    assistant:  down
    user:       ...

Action names come from the environment (``get_action_meanings()``), from the table below for
gymnasium's text games, or from ``--action-names``; an environment whose actions cannot be named
is refused at start.  A turn that names no action is answered with the allowed names and costs
a turn (``env/invalid_actions``); the environment does not step.

A row's columns named like the environment's constructor arguments configure that episode's
environment (FrozenLake's ``desc``: a map of the row's own), so training and held-out rows can
hold different maps.  Episodes are seeded from the run seed, the iteration and the row.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.protocol import describe

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


def constructor_arguments(env_id: str) -> set[str]:
    """The keyword arguments ``gym.make(env_id, ...)`` passes to the environment's class."""
    import gymnasium as gym

    entry = gym.spec(env_id).entry_point
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        import importlib

        entry = getattr(importlib.import_module(module), attribute)
    return set(inspect.signature(entry).parameters) - {"self", "render_mode"}


class GymActionEnvironment:
    """A discrete gymnasium environment behind the text protocol (module docstring)."""

    observation_role = "user"

    def __init__(self, env_id: str, make_kwargs: dict, action_names: list[str] | None = None,
                 observation_text: Callable | None = None, instructions: str | None = None):
        import gymnasium as gym

        self.env_id, self.make_kwargs = env_id, dict(make_kwargs)
        self.observation_text = observation_text
        self.row_arguments = constructor_arguments(env_id)
        self.env_arguments = self.arguments({})
        self.env = self.make(self.env_arguments)
        self.name = f"gym:{env_id}"
        self.action_names = action_names_of(self.env, action_names)
        self.instructions = instructions or (f"You are playing {env_id.split('-')[0]}. Answer each turn with one "
                                             f"action: {', '.join(self.action_names)}.")
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.action_names)) + r")\b", re.IGNORECASE)
        self.tool_stats: dict = {}
        self._gym = gym

    def arguments(self, row: dict) -> dict:
        """The environment's constructor arguments for ``row``: the run's, and the row's own where it names them."""
        return {**self.make_kwargs, **{k: v for k, v in row.items() if k in self.row_arguments}}

    def make(self, arguments: dict):
        import gymnasium as gym

        render_mode = None if self.observation_text is not None else "ansi"
        try:
            return gym.make(self.env_id, render_mode=render_mode, **arguments)
        except TypeError as error:
            raise ConfigError(f"environment gym:{self.env_id}: {error} (from --environment-config or a row's "
                              f"columns)") from None

    def text(self, observation) -> str:
        if self.observation_text is not None:
            return str(self.observation_text(observation, self.env))
        rendered = self.env.render()
        if not isinstance(rendered, str):
            raise ConfigError(f"environment gym:{self.env_id} renders no text (render_mode 'ansi'); give "
                              f"--observation-text module:function (observation, env) -> str")
        return rendered.strip("\n")

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
