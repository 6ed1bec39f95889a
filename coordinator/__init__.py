"""The cachefs coordinator: datasets, preload, jobs, locality API and GPU job placement."""
