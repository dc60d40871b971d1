"""Runs and the commands built on them: a recipe from checks to a published folder (`runner`),
its report (`report`), the dry run (`preflight`), sweeps (`sweep`), and `compress eval`,
`compress compare` and `compress surrogate` (`eval_command`, `compare`, `surrogate`)."""
