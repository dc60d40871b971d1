"""Text in, token windows out: local files or hub datasets cut into windows (`text`), chat
conversations with their assistant-token masks (`chat`), and the `Batch` every consumer reads
(`batches`)."""
