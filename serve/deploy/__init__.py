"""Running the service elsewhere: the Triton model repository and its Python-backend models, a local tritonserver,
and the Ray Serve app."""
