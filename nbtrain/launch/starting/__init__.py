"""Starting the ranks: the ways (fork, a fork server, spawn), registered by name; the checks that choose one (fork safety, what touched CUDA); the devices asked."""
