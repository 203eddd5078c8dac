//! Server-Server API: the server signing key and the key server endpoint
