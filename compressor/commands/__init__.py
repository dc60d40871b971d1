"""The commands built on runs, other than `compress run`: `compress sweep` (`sweep`), `compress eval`
(`eval_command`), `compress compare` (`compare`), `compress surrogate` (`surrogate`) and
`compress export` (`gguf`)."""
