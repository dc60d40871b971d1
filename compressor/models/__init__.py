"""Model families and what a sliced model is: each family described in one place (`families`),
the sliced classes that carry per-site widths and transitions (`sliced`), the stock export of a
one-basis model (`stock`), the site ids and widths of a layout (`sites`), parameter counts
(`budget`), and the modelling code a saved folder carries (`export`). Knows nothing of recipes,
strategies or runs."""
