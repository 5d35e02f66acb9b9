"""tpshard's version, as tpshard.__version__ and the tool_version of every manifest it writes.

A module of its own, not a name in tpshard/__init__.py: the writers read it without importing the
package's __init__, which reaches tpshard.check (its `check` attribute), which reads through the
writer.
"""

__version__ = "0.1.0"
