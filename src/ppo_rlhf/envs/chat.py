"""The chat template across an episode's turns (docs/agents.md, "Chat templates").

An episode keeps the tokens the model sampled and tokenizes only what the environment adds, as
the chat template continues a conversation after an assistant turn (:class:`ChatContinuation`).
That needs a template that writes earlier turns the same whatever follows them (prefix-preserving)
and ends an assistant turn with a token the tokenizer knows as special.  :func:`prepare_episode_chat`
checks both at start, before any model loads, for the answers the run's environments give (tool
messages, or their observations), with every tool; swaps in ppo-rlhf's training template for
Qwen3's (which writes a turn's think block only while the turn is last, as TRL swaps in its own);
refuses any other template that fails, naming it and the fix for what it does, and offering only
the templates ppo-rlhf ships that the tokenizer can run; and resolves ``--tool-parser auto`` for the
template, or checks a parser named against it (envs/parsers.py).
"""

from __future__ import annotations

from importlib.resources import files

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.options import check_template_renders_tools, tool_template_path
from ppo_rlhf.envs.parsers import resolve_parser

QWEN3_MARKERS = ("<|im_start|>", "<think>", "last_query_index", "reasoning_content")


def qwen3_training_template_path():
    """ppo-rlhf's Qwen3 template for training on episodes (every assistant turn with its think block)."""
    return files("ppo_rlhf.envs").joinpath("qwen3_training.jinja")


def template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template.get("default") if isinstance(template, dict) else template


def special_texts(tokenizer) -> list[str]:
    """The text of every special token (a template's end-of-turn is one), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token))
    return sorted((t for t in texts if t), key=len, reverse=True)


class TemplateProblem(ValueError):
    """A chat template an episode cannot continue with; the message says what it does."""

    def __str__(self) -> str:
        return (f"the chat template {self.args[0]}, so an episode cannot continue from the tokens the model wrote; "
                f"use another template (--chat-template-file)")


SENTINEL = "sentinel-4f9a"  # an answer's words in the checks at start: kept by every template, JSON or not


class ChatContinuation:
    """The tokens that follow a model's turn when the environment answers it, as the chat template
    writes them.

    The template is rendered on a stand-in conversation that ends with an assistant turn (carrying
    a call of the answering tool, where tools answer: GPT-OSS's template names the tool of a tool
    message from the turn before), closed there, and continued with the environment's messages and
    the next assistant opening.  The assistant turn ends at the last special token the template
    writes in it (``<|im_end|>``, ``<|eot_id|>``, ``<|call|>``, ...); the continuation is what
    follows it, after that token itself where the model did not write it (a turn cut short, or one
    ended by another stop id).  Its ids are read off the whole rendering tokenized, past the closed
    turn's (as TRL does), never off the continuation's text tokenized alone: a SentencePiece
    tokenizer would put a prefix space in front of a text tokenized on its own."""

    STAND_IN = "\x00assistant-turn\x00"

    def __init__(self, tokenizer, tools: list[dict] | None, chat_template: str | None = None):
        self.tokenizer, self.tools, self.template = tokenizer, tools or None, chat_template
        self.specials = special_texts(tokenizer)
        self.closed: dict = {}  # the answering tool's name (None: no tool) -> the stand-in conversation, closed
        self.ends: dict = {}  # the same -> (where the turn's end token starts in it, the token)
        self.anchor_ids: dict = {}  # (tool name, anchor end) -> the anchor's ids

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **({"chat_template": self.template} if self.template else {}))

    def stand_in(self, answer: list[dict]) -> list[dict]:
        turn = {"role": "assistant", "content": self.STAND_IN}
        if answer and answer[0].get("role") == "tool":
            turn["tool_calls"] = [{"type": "function", "function": {"name": answer[0].get("name") or "tool",
                                                                    "arguments": {}}}]
        return [{"role": "user", "content": "?"}, turn]

    def closed_text(self, tool: str | None, base: list[dict]) -> str:
        """The stand-in conversation closed after its assistant turn."""
        if tool not in self.closed:
            self.closed[tool] = self.render(base, add_generation_prompt=False)
        return self.closed[tool]

    def turn_end(self, tool: str | None, base: list[dict]) -> tuple[int, str]:
        """(where the stand-in assistant turn's end token starts in the closed text, that token):
        the last special token the template writes in the turn; ValueError for a template that
        ends the turn with none."""
        if tool not in self.ends:
            closed = self.closed_text(tool, base)
            opening = self.render(base[:1], add_generation_prompt=True)
            start = len(opening) if closed.startswith(opening) else 0
            found = max(((closed.rfind(token, start), token) for token in self.specials), default=(-1, ""))
            if found[0] < 0:
                raise TemplateProblem(self.NO_END)
            self.ends[tool] = found
        return self.ends[tool]

    def ids(self, messages: list[dict], last_token: int | None, stopped: bool) -> list[int]:
        """Token ids continuing a model turn that ended with ``last_token`` (``stopped``: a stop id)."""
        base = self.stand_in(messages)
        tool = base[1].get("tool_calls", [{}])[0].get("function", {}).get("name")
        closed = self.closed_text(tool, base)
        full = self.render(base + messages, add_generation_prompt=True)
        if not full.startswith(closed):
            raise TemplateProblem(self.REWRITES)
        end, token = self.turn_end(tool, base)
        written = self.tokenizer.decode([last_token]) if stopped and last_token is not None else None
        anchor = end + len(token) if written == token else end  # the model wrote the end token itself, or not
        key = (tool, anchor)
        if key not in self.anchor_ids:
            self.anchor_ids[key] = self.encode(closed[:anchor])
        before, whole = self.anchor_ids[key], self.encode(full)
        if whole[:len(before)] == before:
            return whole[len(before):]
        return self.encode(full[anchor:])  # a tokenizer that merges across the turn's end: the text alone

    REWRITES = "renders an assistant turn differently once messages follow it"
    NO_END = "ends an assistant turn with no token the tokenizer marks as special"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_sample(kind, environment, tools: list[dict]) -> list[dict]:
    """The message(s) an environment of this kind answers a turn with, for the checks at start."""
    if kind.answers == "tools" and tools:
        return [{"role": "tool", "name": tools[0]["function"]["name"], "content": SENTINEL}]
    return [{"role": getattr(environment, "observation_role", "user"), "content": SENTINEL}]


def continuation_problem(tokenizer, tools: list[dict], answer: list[dict], template: str | None) -> str | None:
    """What stops an episode continuing with this template (None: nothing)."""
    continuation = ChatContinuation(tokenizer, tools, template)
    try:
        ids = continuation.ids(answer, None, stopped=False)
    except TemplateProblem as problem:
        return problem.args[0]
    except Exception as error:  # noqa: BLE001 -- a template that raises on the stand-in conversation
        role = answer[0]["role"]
        return f"raises on an assistant turn followed by a {role} message ({type(error).__name__}: {error})"
    if SENTINEL not in continuation.tokenizer.decode(ids):
        return f"leaves out a {answer[0]['role']} message that follows an assistant turn"
    return None


def template_fix(problem: str, tokenizer, answer: list[dict]) -> str:
    """What a template needs for an episode to continue, for the problem found in it
    (:func:`continuation_problem`)."""
    if problem == ChatContinuation.NO_END:
        return (f"give a template that ends each assistant turn with a token the tokenizer marks as special (its EOS "
                f"token {tokenizer.eos_token!r}, or an end-of-turn marker added to it as a special token: "
                f"tokenizer.add_special_tokens)")
    if problem == ChatContinuation.REWRITES:
        return "give a template that writes earlier turns the same whatever follows them"
    return f"give a template that renders an assistant turn followed by a {answer[0]['role']} message"


def shipped_template_paths() -> list[tuple[str, object]]:
    """The templates ppo-rlhf ships for episodes: (what they are for, path)."""
    return [("ChatML models such as SmolLM2 and Qwen", tool_template_path()),
            ("Qwen3", qwen3_training_template_path())]


def shipped_template_problem(tokenizer, source, template: str) -> str | None:
    """What stops ``template`` running this run's episodes on ``tokenizer`` (None: nothing): it
    renders the tools and continues after every answer the environments give."""
    for kind in source.kinds.values():
        environment = source.first(kind)
        tools = list(getattr(environment, "tools", None) or [])
        problem = continuation_problem(tokenizer, tools, answer_sample(kind, environment, tools), template)
        if problem:
            return problem
    return None


def shipped_templates_offer(tokenizer, source) -> str:
    """The end of a template refusal: the templates ppo-rlhf ships that this tokenizer can run, or
    why none can -- never one that would be refused in its turn (both end a turn with ChatML's
    <|im_end|>, which a tokenizer must mark as special)."""
    runnable, problem = [], None
    for what, path in shipped_template_paths():
        problem_here = shipped_template_problem(tokenizer, source, path.read_text())
        if problem_here is None:
            runnable.append(f"for {what}: {path}")
        problem = problem or problem_here
    if runnable:
        return f" (ppo-rlhf ships templates that run on this tokenizer, {'; '.join(runnable)})"
    return (f" (the templates ppo-rlhf ships do not run on this tokenizer: ppo-rlhf's ChatML template {problem} "
            f"here; write one in the model's own format)")


def rendered_prompt(tokenizer, source, messages: list[dict], environment) -> str:
    """An episode's prompt as the model reads it: its messages with its environment's tools listed."""
    return tokenizer.apply_chat_template(messages, tools=list(getattr(environment, "tools", None) or []) or None,
                                         tokenize=False, add_generation_prompt=True,
                                         **({"chat_template": source.chat_template} if source.chat_template else {}))


def too_long_for_its_tools(where: str, tokens: int, max_prompt_length: int) -> str:
    """The refusal of a prompt whose cut would drop the tools its template lists first."""
    return (f"{where} is {tokens} tokens once the chat template lists its tools, more than --max-length minus "
            f"--max-new-tokens ({max_prompt_length}); a prompt is cut from its start, which would take away the "
            f"tools the model is to call: raise --max-length to at least {tokens} plus --max-new-tokens, or shorten "
            f"the tools' docstrings")


def episode_prompt_lengths(tokenizer, source, rows: list[dict], field: str, max_prompt_length: int) -> list[int]:
    """Each row's prompt length in tokens as an episode renders it (its environment's tools listed;
    what reset() adds is not known before it runs); ConfigError at start for a prompt that lists
    tools and is too long to keep them."""
    environments, rendered = [], []
    for row in rows:
        prompt = row.get(field)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        environments.append(source.first(source.kinds[source.kind_name(row)]))
        rendered.append(rendered_prompt(tokenizer, source, messages, environments[-1]))
    lengths = [len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    for row, length, environment in zip(rows, lengths, environments):
        if length > max_prompt_length and getattr(environment, "tools", None):
            raise ConfigError(too_long_for_its_tools(f"the prompt of {row.get('_source', 'a row')}", length,
                                                     max_prompt_length))
    return lengths


def template_name(model: str | None, chat_template_file: str | None) -> str:
    """The chat template a run uses, named for messages."""
    if chat_template_file:
        return f"the chat template {chat_template_file} (--chat-template-file)"
    return f"the chat template of {model or 'the model'}"


def prepare_for_config(tokenizer, source, config) -> None:
    """A run's episode chat at start (``config``: ppo's or eval's): --chat-template-file applied to
    ``tokenizer``, then :func:`prepare_episode_chat`."""
    from ppo_rlhf.envs.options import prepare_template

    prepare_template(tokenizer, config)
    prepare_episode_chat(tokenizer, source, template_name(config.model, config.chat_template_file))


def prepare_episode_chat(tokenizer, source, where: str) -> None:
    """At start, before any model loads: the template renders the run's tools and continues an episode
    after every answer its environments give; Qwen3's is swapped for ppo-rlhf's training template;
    ``--tool-parser auto`` resolved.  Sets ``source.chat_template``, ``source.parser`` and the notes for
    the plan; ConfigError naming ``where`` (the template's owner) and the fix otherwise."""
    template = template_text(tokenizer)
    if template is None:
        raise ConfigError(f"{where.replace('the chat template of ', '')} has no chat template, and an episode's turns "
                          f"are chat messages; give one with --chat-template-file"
                          f"{shipped_templates_offer(tokenizer, source)}")
    check_template_renders_tools(tokenizer, source.tools, where, lambda: shipped_templates_offer(tokenizer, source))
    chosen = None
    for kind in source.kinds.values():
        environment = source.first(kind)
        tools = list(getattr(environment, "tools", None) or [])
        answer = answer_sample(kind, environment, tools)
        problem = continuation_problem(tokenizer, tools, answer, chosen)
        if problem and chosen is None and all(marker in template for marker in QWEN3_MARKERS):
            chosen = qwen3_training_template_path().read_text()
            source.notes.append(f"chat template: Qwen3's writes a turn's think block only while the turn is last, so "
                                f"episodes render with ppo-rlhf's training template ({qwen3_training_template_path()}"
                                f"), which writes it in every turn")
            problem = continuation_problem(tokenizer, tools, answer, chosen)
        if problem:
            raise ConfigError(f"{where} {problem}, so an episode cannot continue from the tokens the model wrote; "
                              f"{template_fix(problem, tokenizer, answer)}, with --chat-template-file"
                              f"{shipped_templates_offer(tokenizer, source)}")
    source.chat_template = chosen
    if any(kind.answers == "tools" for kind in source.kinds.values()):
        source.parser, name = resolve_parser(source.parser, tokenizer, chosen or template, source.tools, where)
        if source.parser_name == "auto":
            source.parser_name = f"auto: {name}"
        for kind in source.kinds.values():
            for environment in kind.pool:
                if hasattr(environment, "parser"):
                    environment.parser = source.parser
