//! Element X's flow against the real `spindle` binary, driven by matrix-rust-sdk (the
//! SDK Element X is built on): log in, the room list service (Simplified Sliding Sync,
//! MSC4186) lists the rooms in recency order, a new message bumps its room to the top,
//! and the room's timeline shows the message.
//!
//! The binary comes from `SPINDLE_BIN` (`scripts/test` builds it and sets it).

mod common;

use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use common::{Server, WAIT};
use futures_util::StreamExt;
use matrix_sdk::{
    Client,
    ruma::{
        OwnedRoomId, RoomId,
        api::client::room::create_room::v3::{Request as CreateRoomRequest, RoomPreset},
        events::room::message::RoomMessageEventContent,
    },
};
use matrix_sdk_ui::{
    RoomListService,
    eyeball_im::Vector,
    room_list_service::{RoomListItem, filters::new_filter_non_left},
    timeline::RoomExt,
};

/// Applies room list diffs until `want` (room ids, in order) is the list, or fails.
async fn wait_for_order(
    stream: &mut (
             impl futures_util::Stream<Item = Vec<matrix_sdk_ui::eyeball_im::VectorDiff<RoomListItem>>>
             + Unpin
         ),
    list: &mut Vector<RoomListItem>,
    want: &[&OwnedRoomId],
) -> Result<()> {
    let ids = |list: &Vector<RoomListItem>| -> Vec<OwnedRoomId> {
        list.iter().map(|r| r.room_id().to_owned()).collect()
    };
    let want: Vec<OwnedRoomId> = want.iter().map(|r| (*r).clone()).collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    while ids(list) != want {
        let diffs = tokio::time::timeout_at(deadline, stream.next())
            .await
            .map_err(|_| anyhow!("room list is {:?}, expected {:?}", ids(list), want))?
            .ok_or_else(|| anyhow!("room list stream ended"))?;
        for diff in diffs {
            diff.apply(list);
        }
    }
    Ok(())
}

async fn create_named_room(client: &Client, name: &str) -> Result<OwnedRoomId> {
    let mut req = CreateRoomRequest::new();
    req.name = Some(name.to_owned());
    req.preset = Some(RoomPreset::PublicChat);
    Ok(client.create_room(req).await?.room_id().to_owned())
}

async fn send_text(client: &Client, room: &RoomId, body: &str) -> Result<()> {
    let room = client
        .get_room(room)
        .ok_or_else(|| anyhow!("{room} unknown to the sender"))?;
    room.send(RoomMessageEventContent::text_plain(body)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_list_service_orders_by_recency_and_the_timeline_shows_new_messages() -> Result<()> {
    let server = Server::start().await?;
    let result = flow(&server).await;
    if result.is_err() {
        eprintln!("--- spindle stderr ---\n{}", server.log_tail());
    }
    drop(server.child);
    result
}

async fn flow(server: &Server) -> Result<()> {
    server.register("alice").await?;
    server.register("bob").await?;
    let setup = server.login("alice").await?;
    let bob = server.login("bob").await?;
    let first = create_named_room(&setup, "first").await?;
    let second = create_named_room(&setup, "second").await?;
    let third = create_named_room(&setup, "third").await?;
    for room in [&first, &second, &third] {
        bob.join_room_by_id(room).await?;
    }
    // Recency: third, second, first.
    for (room, body) in [(&first, "one"), (&second, "two"), (&third, "three")] {
        send_text(&bob, room, body).await?;
    }

    // Element X: a fresh login, then the room list service.
    let alice = server.login("alice").await?;
    let service = std::sync::Arc::new(RoomListService::new(alice.clone()).await?);
    let sync = {
        let service = service.clone();
        tokio::spawn(async move {
            let stream = service.sync();
            futures_util::pin_mut!(stream);
            while let Some(r) = stream.next().await {
                if let Err(e) = r {
                    return Err(anyhow!("room list sync failed: {e}"));
                }
            }
            Ok(())
        })
    };
    let all_rooms = service.all_rooms().await?;
    let (stream, controller) = all_rooms.entries_with_dynamic_adapters(50);
    futures_util::pin_mut!(stream);
    controller.set_filter(Box::new(new_filter_non_left()));
    let mut list = Vector::new();
    wait_for_order(&mut stream, &mut list, &[&third, &second, &first]).await?;
    // The names come from `required_state` (`m.room.name`); the SDK may publish the
    // list order a moment before it has stored the rooms' state, so poll (bounded).
    let want_names = vec![
        Some("third".to_owned()),
        Some("second".to_owned()),
        Some("first".to_owned()),
    ];
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let names: Vec<Option<String>> = list.iter().map(|r| r.name()).collect();
        if names == want_names {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("room names are {names:?}, expected {want_names:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A new message bumps its room to the top.
    send_text(&bob, &first, "bump").await?;
    wait_for_order(&mut stream, &mut list, &[&first, &third, &second]).await?;

    // And the room's timeline shows it.
    let room = service.room(&first)?;
    let timeline = room.timeline().await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let bodies: Vec<String> = timeline
            .items()
            .await
            .iter()
            .filter_map(|item| item.as_event())
            .filter_map(|ev| ev.content().as_message().map(|m| m.body().to_owned()))
            .collect();
        if bodies.last().map(String::as_str) == Some("bump") {
            assert!(bodies.contains(&"one".to_owned()), "{bodies:?}");
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the timeline of {first} never showed the new message: {bodies:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if sync.is_finished() {
        sync.await??;
    }
    service.stop_sync()?;
    Ok(())
}
