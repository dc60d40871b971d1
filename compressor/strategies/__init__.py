"""Selection strategies: the contract a strategy implements (`contract`) and the pluggy registry
that finds strategies and model families in installed plugins (`registry`). The built-in
strategies live in the top-level `plugins/` folder and load through the same entry points as a
third party's."""
