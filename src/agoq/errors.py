"""The error a bad setting is refused with, below every layer: the file writers that refuse links
(agoq.nofollow) raise it as the config's own checks do, and the command line prints it as
one line."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names it and the fix."""
