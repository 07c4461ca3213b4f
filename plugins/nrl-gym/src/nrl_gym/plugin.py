"""Registers the NeMo Gym agent and dataset (targets are strings: nothing heavy is imported)."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_agents(register):
    register(
        "nemo_gym",  # nrl_gym.agent.AGENT_NAME (not imported here: the plugin stays light)
        "nrl_gym.agent:NemoGymAgent",
        config="nrl_gym.config:NemoGymAgentConfig",
        description="NeMo Gym environments: rows run by Gym's agents against nrl's endpoint",
    )


@hookimpl
def nrl_register_datasets(register):
    register(
        "nemo_gym_jsonl",
        "nrl_gym.dataset:NemoGymDataset",
        config="nrl_gym.config:NemoGymDataConfig",
        description="NeMo Gym JSONL rows (responses_create_params, agent_ref, extra fields)",
    )
