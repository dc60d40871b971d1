"""What a run works with: the model, tokenizer, device and data windows (`loading`), the output's
staging folder (`staging`), checkpoint fingerprints and resume (`resume`), torch's CPU threads
(`threads`) and evaluation layer by layer (`layerwise_eval`)."""
