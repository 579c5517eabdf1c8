"""What TRL's scripts import from ``trl.trainer.utils``: ``SIMPLE_CHAT_TEMPLATE`` (TRL 0.23's, Apache-2.0,
(c) the HuggingFace team), the template TRL's PPO scripts give a tokenizer that has none."""

SIMPLE_CHAT_TEMPLATE = ("{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + "
                        "'\n\n'}}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
