"""A run: a recipe from its plan to a published folder (`runner`: staging, the stages in order, the
held-out guard, publishing), and a data-parallel run's ranks above 0 (`follower`)."""
