"""The `gasloc` command line: the root click group and the commands that belong to no single component
(`swarm`, `doctor`, `presets`, `config-reference`). Component commands live beside their component."""
