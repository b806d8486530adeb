"""Results: the typed stage record (one reader), and what is rendered or checked from stored records."""
