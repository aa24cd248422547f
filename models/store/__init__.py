"""The model store: sources, the registry of known ids, atomic installs."""
