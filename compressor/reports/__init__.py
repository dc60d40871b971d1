"""What a run reports: `report.json` as a typed model (`report_model`), its tables (`report`) and the
held-out guard's record (`guard`)."""
