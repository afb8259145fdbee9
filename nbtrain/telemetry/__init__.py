"""What each rank reports while it trains, and how it reaches the kernel: typed events
(``events``), the authenticated channel (``channel``), the rank's recorder and memory
probes, the run's history and summary, and the sinks that consume events."""
