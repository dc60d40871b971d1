"""A recipe's sections, one module each: its options class and the checks past types and ranges
(`contract.Section`), in the order they are checked (`order.BUILTIN_SECTIONS`)."""
