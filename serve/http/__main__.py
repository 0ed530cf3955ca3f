"""`python -m serve.http`: the server (`serve.http.server.main`)."""

from serve.http.server import main

main()
