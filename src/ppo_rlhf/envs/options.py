"""The options of multi-turn episodes, shared by ``ppo`` and ``eval`` (docs/agents.md)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from ppo_rlhf.config import EPISODES, ConfigError, above, any_number, at_least, check, option
from ppo_rlhf.envs.calls import ENV_WORKERS

TURN_REWARDS = ("sum", "per-turn")
# --max-length left empty: a single turn's prompt and answer, or an episode's prompt (its tools
# listed) and several turns; docs/agents.md's calculator example needs ~180 prompt tokens.
DEFAULT_MAX_LENGTH, EPISODE_MAX_LENGTH = 256, 1024


@dataclass
class EnvironmentOptions:
    option_group = EPISODES  # --help's group of all these options (config.py, GROUPS)

    environment: str | None = option(None, "play each prompt as a multi-turn episode with an environment: "
                                           "module:Class (TRL's environment_factory shape -- reset() and tool "
                                           "methods -- or gymnasium's reset / step in text), gym:ID (a gymnasium "
                                           "environment with discrete actions, played by their names, e.g. "
                                           "gym:FrozenLake-v1), or textarena:ID (pip install -e '.[envs]')")
    tool: list[str] = option([], "a tool the model may call, module:function (type hints and a docstring give its "
                                 "schema); repeat the flag for several; alone, an episode ends at the first turn "
                                 "without a tool call")
    agent: str | None = option(None, "play each prompt with an agent of your own, module:function called as "
                                     "function(client, model, row) and returning the episode's reward: client an "
                                     "openai.OpenAI (AsyncOpenAI for an async def) on the generation server's "
                                     "OpenAI-compatible endpoint, model the name to call; every call is answered by "
                                     "the current policy and trained on as sampled (--rollout-engine vllm-server)")
    max_turns: int = option(8, "with --environment or --tool: the model's turns in an episode at most (--agent: "
                               "its calls to the model)", range=above(0))
    max_episode_tokens: int | None = option(None, "with --environment or --tool: the tokens after the prompt at most "
                                                  "(the model's and the environment's); empty: what --max-length "
                                                  "leaves after the prompt", range=above(0))
    tool_timeout: float = option(10.0, "seconds a tool call may take; past it the model is told the tool timed out",
                                 range=above(0))
    env_workers: int = option(ENV_WORKERS, "with --environment or --tool: how many plain-def environment calls (reset, step, "
                                  "tools, get_reward) of different episodes run at once, each on a thread; async def "
                                  "ones are awaited together whatever this is.  64: the tools agents call mostly wait "
                                  "(a server, a sandbox, a database), and a waiting thread costs little and holds no "
                                  "core, so a batch's waits overlap; 1 runs them one after another, for an "
                                  "environment that is not thread-safe", range=at_least(1))
    tool_parser: str = option("auto", "how tool calls are read from the model's text: auto (the tokenizer's "
                                      "response_template where it has one, else by the chat template's family: "
                                      "hermes, llama3-json or gpt-oss), hermes (<tool_call>{\"name\": ..., "
                                      "\"arguments\": {...}}</tool_call>: Qwen, Hermes, SmolLM3), llama3-json "
                                      "({\"name\": ..., \"parameters\": {...}}: Llama 3.x), gpt-oss "
                                      "(to=functions.NAME ... <|call|>), or module:function (text -> list of ToolCall)")
    environment_config: str = option("", "arguments the environment is made with, 'key=value,...' (values read as "
                                          "YAML), e.g. is_slippery=false for gym:FrozenLake-v1")
    action_names: list[str] = option([], "gym:ID: the name of each action, in the action order (default: the "
                                         "environment's own, or ppo-rlhf's table for gymnasium's text games)")
    observation_text: str | None = option(None, "gym:ID: module:function (observation, env) -> text, to show the "
                                                "model each observation (default: the environment's ansi render)")
    turn_rewards: str = option("sum", "the environment's step rewards: sum (the episode's total, at its last token, "
                                      "like any score) or per-turn (each on the last token of the turn it answered; "
                                      "estimators gae and reinforce++, which credit tokens by their return)",
                               choices=TURN_REWARDS)
    environment_reward_weight: float = option(1.0, "weight of the environment's rewards in an episode's score, "
                                                   "beside --reward-weights' for the other rewards",
                                              range=any_number())
    chat_template_file: str | None = option(None, "a Jinja chat template to use instead of the tokenizer's (one that "
                                                  "renders tools, for a model whose own does not); saved with the "
                                                  "trained model")
    chat_template_kwargs: str = option("", "variables every rendering of the chat template gets, 'key=value,...' "
                                           "(values read as YAML; TRL's chat_template_kwargs), e.g. "
                                           "enable_thinking=false for Qwen3's template")

    def template_kwargs(self) -> dict:
        """--chat-template-kwargs as a dict (ConfigError naming it for a malformed one)."""
        from ppo_rlhf.config_yaml import parse_key_values

        return parse_key_values(self.chat_template_kwargs or "", "chat_template_kwargs", "enable_thinking=false")

    def resolve_max_length(self) -> None:
        """--max-length left empty: 256, or 1024 where rollouts are episodes (by the flags, or objects
        given in Python, recorded in the config before it is checked again); resolved here, so
        config.yaml records the value used."""
        if self.max_length is None:
            self.max_length_resolved = True  # left empty: a later check (objects given in Python) may resolve it again
        if getattr(self, "max_length_resolved", False):
            self.max_length = EPISODE_MAX_LENGTH if self.has_episodes() else DEFAULT_MAX_LENGTH

    def has_episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes (by the flags, or objects given to PPOTrainer, recorded so)."""
        return self.environment is not None or bool(self.tool) or self.agent is not None

    def check_episode_options_used(self) -> None:
        """At start, once it is known whether rollouts are episodes: an episode option set without
        them is refused (an environment or tools given to PPOTrainer as Python objects are recorded
        in ``environment`` and ``tool`` before; a config may be built with episode options for
        them, so this is not a rule of the config alone)."""
        if self.has_episodes():
            return
        for field in fields(EnvironmentOptions):
            if field.name not in ("environment", "tool", "chat_template_file", "chat_template_kwargs"):  # any chat
                default = field.default if field.default_factory is MISSING else field.default_factory()
                check(getattr(self, field.name) == default, field.name,
                      "left out without --environment or --tool (or --agent)", getattr(self, field.name))

    def validate_environment(self) -> None:
        """The rules between the episode options, where rollouts are episodes (by the flags, or
        objects given to PPOTrainer, recorded in ``environment`` and ``tool`` before it checks the
        config again); --chat-template-kwargs' form for every run."""
        self.template_kwargs()
        if not self.has_episodes():
            return
        if self.agent is not None:
            self.validate_agent()
            return
        require_chat_template(self, "--environment / --tool (an episode's turns are chat messages)")
        gym = (self.environment or "").startswith("gym:")
        for key in ("action_names", "observation_text"):
            check(gym or not getattr(self, key), key, "left out without --environment gym:ID", getattr(self, key))
        if self.turn_rewards == "per-turn" and getattr(self, "estimator", "gae") not in ("gae", "reinforce++"):
            raise ConfigError(f"invalid value for 'turn_rewards': 'per-turn' with estimator {self.estimator}; a "
                              f"group or greedy baseline compares whole episodes (sum), per-turn rewards need an "
                              f"estimator that credits each token by its return: gae or reinforce++")
        if getattr(self, "overlong_buffer", None) is not None:
            raise ConfigError("invalid value for 'overlong_buffer': not with --environment or --tool; it counts a "
                              "response down to --max-new-tokens, a turn's limit, where an episode holds several "
                              "turns (--max-episode-tokens bounds an episode)")
        if self.max_episode_tokens is not None:
            check(self.max_episode_tokens < self.max_length, "max_episode_tokens",
                  f"< max_length ({self.max_length}), which holds the prompt and the episode", self.max_episode_tokens)
        from ppo_rlhf.envs import parse_config_values

        parse_config_values(self.environment_config)  # a malformed one fails here, at start


    def validate_agent(self) -> None:
        """--agent plays the episodes itself, on a generation server's OpenAI endpoint: no
        environment or tool beside it, none of the options of the episodes ppo-rlhf plays."""
        check(getattr(self, "rollout_engine", "vllm-server") == "vllm-server", "agent",
              "left out without --rollout-engine vllm-server (an agent calls a generation server's OpenAI-compatible "
              "endpoint: ppo-rlhf serve)", self.agent)
        for key in ("environment", "tool"):
            check(not getattr(self, key), key, "left out with --agent (the agent plays the episodes itself; give "
                                               "it its tools)", getattr(self, key))
        for key in ("action_names", "observation_text", "max_episode_tokens"):
            check(not getattr(self, key), key, "left out with --agent (--max-length bounds an agent's episode)",
                  getattr(self, key))
        check(self.turn_rewards == "sum", "turn_rewards", "sum with --agent (the agent returns one reward)",
              self.turn_rewards)
        check(self.environment_config == "", "environment_config", "left out with --agent", self.environment_config)


def check_template_renders_tools(tokenizer, schemas: list[dict], where: str, offer=lambda: "") -> None:
    """ConfigError at start when tools are given but the chat template leaves them out of the
    prompt, or cannot render a tool's answer: the model would never learn they exist.  ``where``
    names the template (envs/chat.py, ``template_name``); ``offer()``: the templates ppo-rlhf ships
    that this tokenizer can run, for the message (envs/chat.py, ``shipped_templates_offer``; none
    by default)."""
    if not schemas:
        return
    name = schemas[0]["function"]["name"]
    question = [{"role": "user", "content": "?"}]
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    answered = question + [{"role": "assistant", "content": "!", "tool_calls": [call]},
                           {"role": "tool", "name": name, "content": "sentinel-4f9a"}]
    try:
        listed = name in tokenizer.apply_chat_template(question, tools=schemas, tokenize=False,
                                                       add_generation_prompt=True)
        answers = "sentinel-4f9a" in tokenizer.apply_chat_template(answered, tools=schemas, tokenize=False,
                                                          add_generation_prompt=True)
        problem = None if listed and answers else ("does not list the tools in the prompt" if not listed else
                                                   "does not render a tool's answer (role 'tool')")
    except Exception as error:  # noqa: BLE001 -- a template that raises on tools or a tool message
        problem = f"raises on tools ({type(error).__name__}: {error})"
    if problem:
        raise ConfigError(f"{where} {problem}, so the model cannot see its tools; give a template "
                          f"that renders them with --chat-template-file{offer()}")


QUESTION = "sentinel-4f9a"  # a user's question in the template checks: kept by every template, JSON or not


def tool_template_path():
    """The ChatML template with tools that ppo-rlhf ships (Hermes-style tool calls)."""
    from importlib.resources import files

    return files("ppo_rlhf.envs").joinpath("chatml_tools.jinja")


def apply_chat_template_file(tokenizer, path: str | None) -> None:
    """--chat-template-file: the tokenizer formats with that template from now on (and is saved with it)."""
    if path is None:
        return
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"invalid value for 'chat_template_file': {path!r}; no such file (a Jinja chat template)")
    template = file.read_text()
    if not template.strip():  # it would render every prompt as no tokens at all
        raise ConfigError(f"invalid value for 'chat_template_file': {path!r}; the file is empty; give a Jinja chat "
                          f"template that writes each message (the model's own, or one of its family's)")
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], chat_template=template,
                                                 tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 -- jinja's syntax errors, a template that raises on a plain question
        raise ConfigError(f"invalid value for 'chat_template_file': {path!r}; the template does not render a user's "
                          f"question ({type(error).__name__}: {error})") from None
    if QUESTION not in rendered:
        raise ConfigError(f"invalid value for 'chat_template_file': {path!r}; the template leaves a user's question "
                          f"out of what it writes (it rendered {rendered[:80]!r}), so the model would never read the "
                          f"prompts; write each message's content ({{{{ message['content'] }}}})")
    tokenizer.chat_template = template


def apply_chat_template_kwargs(tokenizer, kwargs: dict) -> None:
    """--chat-template-kwargs: every ``apply_chat_template`` of this tokenizer renders with them (a
    call's own keywords win), the prompts', the episodes' and the checks' alike, as TRL passes
    ``chat_template_kwargs`` to each of its renderings.  Set on the tokenizer object, not saved
    with it: the trained model's template stays its own."""
    if not kwargs:
        return
    render = type(tokenizer).apply_chat_template

    def apply_chat_template(conversation, *args, **given):
        return render(tokenizer, conversation, *args, **{**kwargs, **given})

    tokenizer.apply_chat_template = apply_chat_template
    tokenizer.chat_template_kwargs = dict(kwargs)


def prepare_template(tokenizer, config) -> None:
    """What a run's options do to the tokenizer's chat template: --chat-template-file, then
    --chat-template-kwargs."""
    apply_chat_template_file(tokenizer, config.chat_template_file)
    apply_chat_template_kwargs(tokenizer, config.template_kwargs())


def require_chat_template(config, asked_by: str) -> None:
    """What ``asked_by`` needs: prompts formatted by the chat template.  On unless it was turned off
    (``--no-chat-template``, refused by name: the run would otherwise turn it on again, and record it
    on, without a word)."""
    if config.chat_template is False:
        raise ConfigError(f"invalid value for 'chat_template': False with {asked_by}, which only the chat template "
                          f"can format; leave --no-chat-template out")
    config.chat_template = True


def check_template_file_used(config) -> None:
    """ConfigError for a --chat-template-file that a run without a chat template would never read:
    the file would go unchecked and replace the saved model's own template, which the run did not
    use (docs/design.md, "Configuration": only the templates a run used are saved with its model)."""
    check(config.chat_template or config.chat_template_file is None, "chat_template_file",
          "left out without --chat-template (the prompts are not formatted by a template, so the file would only "
          "replace the trained model's own template)", config.chat_template_file)
