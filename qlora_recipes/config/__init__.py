"""The typed configuration: the schema of every group (each field with its default, help, choices
and range), the one loader that composes it, and the hardware a plan is made for."""
