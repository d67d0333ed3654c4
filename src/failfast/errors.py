"""Exceptions that callers can catch: each names the problem in plain words."""


class FailfastError(Exception):
    """Base class of every error failfast raises on bad input."""


class CheckpointError(FailfastError):
    """A model folder is missing, incomplete, corrupt or in an unsupported format."""


class IncompatibleModelsError(FailfastError):
    """Drafter and target cannot work together (for example different vocabularies)."""


class GenerationInputError(FailfastError):
    """A generation request is malformed: empty prompt, context overflow, bad options."""


class PolicyError(FailfastError):
    """Draft-length policy parameters are out of range."""
