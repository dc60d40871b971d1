"""The stages of a run: `contract` (what a stage is), `base` (the state they share), `order` (the
built-in stages in order, a plugin's placed among them), and one module per stage."""
