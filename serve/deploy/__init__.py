"""Running the service elsewhere: the Triton Python-backend sampling loop and the Ray Serve app."""
