"""The planner's one error: what is wrong with its input and what to change, in one line."""


class PlanError(ValueError):
    """Bad planner input (a flag, a profile, a bench result); the CLI prints it as one line."""
