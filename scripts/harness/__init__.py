"""What the measuring scripts and the tests share, kept out of the package: ``ldlm serve`` on loopback in a
child process (``loopback``), the client traffic and reports they send and write (``traffic``), and a model by name (``models``)."""
