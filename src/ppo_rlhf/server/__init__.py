"""The generation server, ``ppo-rlhf serve`` (docs/design.md, "The generation server"): a vLLM
engine in a process of its own that trainers push weights to and take rollouts from, and agents
call as an OpenAI-compatible endpoint."""
