"""Following the ranks once started: their pipes, their states and endings, a failure's stacks and how it is told, the run's links."""
