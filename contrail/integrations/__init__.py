"""Adapters to tools agent-RL researchers already run (TRL; AgentGym lives in `contrail.envs.agentgym`).

Each adapter is its own module, imported on use, so ``import contrail`` needs
none of their libraries.
"""
