"""Prometheus for fedsynth: the scrape config, its file_sd targets and the tool that writes them."""
