"""The plan, made before any weight loads: every check of a recipe against the model's config
(`checks`), the memory plan (`memory`), the time plan (`timing`), the decode-time budget
(`decode_budget`) and the dry run that prints them (`preflight`)."""
