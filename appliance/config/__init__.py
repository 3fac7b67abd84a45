"""``appliance.yaml``: the schema declared as data, the typed config, validation, and the diff between two
configs (all pure)."""
