"""TRL's examples/scripts/openenv/echo.py: a class around OpenEnv's Echo environment client, whose
tool talks to the environment and keeps its reward; the reward function reads it off each
episode's environment.  (OpenEnv's client reaches a server: tests/test_agent_programs.py gives an
``echo_env`` module that answers in-process.)"""

from datasets import Dataset
from echo_env import EchoEnv
from echo_env.models import EchoAction

# TRL: from trl import GRPOConfig, GRPOTrainer
from ppo_rlhf import PPOConfig, PPOTrainer
from trl_examples import BUDGET


def reward_func(environments, **kwargs):
    return [env.reward for env in environments]


def main(model_path: str, out: str, env_host: str = "https://qgallouedec-echo-env.hf.space", **given) -> dict:
    # TRL: args = parse_args()   (--model, --env-host)

    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}],
                [{"role": "user", "content": "Make the environment echo 'Goodbye World!'"}],
                [{"role": "user", "content": "Can you ask the environment to echo 'TRL is great!'?"}],
                [{"role": "user", "content": "What happens if you ask the environment to echo 'I love RLHF!'?"}],
                [{"role": "user", "content": "Try to make the environment echo 'OpenEnv is awesome!'"}],
            ],
        }
    )

    class EchoToolEnv:
        def __init__(self):
            self.env = EchoEnv(base_url=env_host)
            self.reward = 0.0

        def reset(self, **kwargs) -> None | str:
            self.reward = 0.0
            return None

        def echo(self, message: str) -> str:
            """
            Echo the message back from the environment.

            Args:
                message: The message to echo

            Returns:
                The echoed message.
            """
            observation = self.env.step(EchoAction(message=message))
            self.reward = observation.observation.reward
            return observation.observation.echoed_message

    # TRL: trainer = GRPOTrainer(
    # TRL:     model=args.model,
    # TRL:     train_dataset=dataset,
    # TRL:     reward_funcs=reward_func,
    # TRL:     args=GRPOConfig(chat_template_kwargs={"enable_thinking": False}, log_completions=True, logging_steps=2,
    # TRL:                     num_completions_to_print=1),
    # TRL:     environment_factory=EchoToolEnv,
    # TRL: )
    rows = f"{out}.rows.jsonl"
    dataset.to_json(rows)
    trainer = PPOTrainer(PPOConfig(model=model_path, prompts=rows, out=out, **BUDGET), reward=reward_func,
                         environment=EchoToolEnv, **given)
    return trainer.train()
