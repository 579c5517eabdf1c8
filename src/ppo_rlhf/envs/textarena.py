"""TextArena's single-player games (``--environment textarena:GuessTheNumber-v0``; ``pip install
-e ".[envs]"``), played through the gymnasium protocol (docs/agents.md).

TextArena's games run offline and speak text already: ``reset(num_players=1, seed=)``, then
``get_observation()`` (the whole game so far, one growing string) and ``step(text) -> (done,
info)``; ``close()`` returns each player's reward.  The adapter gives the model only what is new
since its last turn (its own move echoed back left out) and the game's reward when it ends.
"""

from __future__ import annotations

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.protocol import Adapter


def require_textarena() -> None:
    try:
        import textarena  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"--environment textarena:...: TextArena is not installed ({error}); pip install -e "
                          f"\".[envs]\" (or pip install textarena)") from None


class TextArenaEnvironment(Adapter):
    """A TextArena game behind the text protocol; ``instance``: the game (reward functions' ``environments``)."""

    observation_role = "user"
    prompt_separator = "\n\n"

    def __init__(self, game: str, make_kwargs: dict):
        import textarena

        try:
            self.env = textarena.make(game, **make_kwargs)
        except Exception as error:  # noqa: BLE001 -- an unknown game id, wrong arguments
            raise ConfigError(f"environment textarena:{game}: {type(error).__name__}: {error}") from None
        self.instance = self.env
        self.name = f"textarena:{game}"
        self.seen = 0  # characters of the game's observation the model has read

    def new_text(self) -> str:
        _, observation = self.env.get_observation()
        text = observation[self.seen:]
        self.seen = len(observation)
        lines = [line for line in text.splitlines() if not line.startswith("[Player]")]
        return "\n".join(lines).strip()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.env.reset(num_players=1, seed=seed)
        self.seen = 0
        return self.new_text(), {}

    def step(self, action: str) -> tuple[str | None, float, bool, bool, dict]:
        done, info = self.env.step(action)
        if not done:
            return self.new_text(), 0.0, False, False, dict(info or {})
        rewards, game_info = self.env.close()
        reward = float((rewards or {}).get(0, 0.0))
        return None, reward, True, False, dict(game_info or {}).get(0, {})
